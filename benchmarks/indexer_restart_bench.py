"""Prefix-hit tokens after a KV indexer restart under traffic, vs an indexer that never restarted (issue 39).

    python benchmarks/indexer_restart_bench.py --warm 60 --measure 100

One launch as ``pdserve serve --policy conductor --routers 2 --start-indexer`` starts it (2 prefill + 1 decode
real vLLM workers on a tiny random Llama, fp32): the launcher's indexer (A) is the one every router replica
seeds from and posts its placements to. A second indexer (B) follows the same workers and is never touched.
Traffic goes through the routers: prompts of a few shared prefixes (2-6 blocks) with their own tails. After
``--warm`` requests A snapshots, takes a few more requests (lost with it), is killed with SIGKILL, misses a
few more while down, and the launcher's supervisor restarts it from its snapshot (it resumes each worker's
stream from the snapshot's batch). Then, for each of the next ``--measure`` requests, A and B are asked
(``POST /query``) how many prompt tokens the best worker holds, before the request is sent: the prefix-hit
tokens a placement from each index would get. The goal is A within 5% of B. The workers' own prefix cache hits
over those requests (vLLM's ``prefix_cache_hits_total``) are printed as the truth both are judged against, and
A's placeholder counters show the routers' placements posted to it and confirmed by the workers' events.
Only the prefill workers count: the prompt is computed there (D's cache hits are the hand-off's blocks).

Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.prom import scrape  # noqa: E402
from pdserve.launch import Cluster  # noqa: E402
from pdserve.launch.commands import kv_publisher_entry  # noqa: E402
from pdserve.launch.config import LauncherConfig  # noqa: E402
from pdserve.launch.models import build_random_llama  # noqa: E402
from pdserve.launch.ports import free_port  # noqa: E402

BLOCK = 128
HITS = "vllm:prefix_cache_hits_total"


def post(url: str, body: Any, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(url: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def prompts(n: int, families: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    fams = [[rng.randrange(1000, 30000) for _ in range(6 * BLOCK)] for _ in range(families)]
    return [fams[i % families][:BLOCK * rng.randrange(2, 7)] + [rng.randrange(1000, 30000)
                                                                   for _ in range(rng.randrange(20, 2 * BLOCK))]
            for i in range(n)]


def best_hit(indexer: str, prompt: list[int], prefill: list[str]) -> int:
    """Prompt tokens the best prefill worker holds, as the indexer sees it (device tier: what vLLM's cache would
    hit where the prompt is computed)."""
    found = post(indexer + "/query", {"model": "rl", "token_ids": prompt, "medium": ["device"]})["default"]
    return max((found.get(w, {}).get("device", 0) for w in prefill), default=0)


def wait_up(url: str, timeout_s: float = 120) -> float:
    t0 = time.monotonic()
    while True:
        try:
            get(url + "/health", timeout=2)
            return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"{url} did not answer /health in {timeout_s:.0f} s") from None
            time.sleep(0.2)


def settled(indexer: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        view = get(indexer + "/global_view")
        if not any(s["catching_up"] for s in view["streams"].values()):
            return view
        if time.monotonic() > deadline:
            raise SystemExit(f"{indexer} still catching up after {timeout_s:.0f} s")
        time.sleep(0.2)


def hits(workers: list[str]) -> float:
    return sum(scrape(w, HITS).get(HITS, 0.0) for w in workers)


def run(a: argparse.Namespace, tmp: Path) -> dict:
    model = build_random_llama(tmp / "model")
    cfg = LauncherConfig(model=str(model), prefill=2, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="rl", run_dir=str(tmp / "run"), worker_timeout_s=900, policy="conductor",
                         routers=2, start_indexer=True, router_args=("--local-prefill-tokens", "0", "--no-calibrate"))
    load_start = os.getloadavg()
    with Cluster(cfg, log=lambda s: print(f"[serve] {s}", file=sys.stderr)) as c:
        c.supervise_in_background()
        (ix,) = c.services
        a_url = ix.url
        entries = [kv_publisher_entry(w) for w in c.plan.workers if w.kv_events_endpoint]
        b_port = free_port()
        b_url = f"http://127.0.0.1:{b_port}"
        b = subprocess.Popen([sys.executable, "-m", "pdserve.indexer", "--indexer-port", str(b_port),
                              *[x for e in entries for x in ("--kv-events", e)]],
                             stdout=open(tmp / "indexer-b.log", "ab"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            wait_up(a_url)
            wait_up(b_url)
            ps = prompts(a.warm + 2 * a.gap + a.measure, a.families, a.seed)
            send = lambda p: post(c.router_url + "/v1/completions",  # noqa: E731
                                  {"model": "rl", "prompt": p, "max_tokens": 2, "temperature": 0})
            i = 0
            for _ in range(a.warm):
                send(ps[i])
                i += 1
            snap = post(a_url + "/snapshot", {})
            for _ in range(a.gap):  # applied by A after its snapshot: lost when it is killed
                send(ps[i])
                i += 1
            pid = ix.pid
            os.killpg(os.getpgid(pid), signal.SIGKILL)
            t_kill = time.monotonic()
            for _ in range(a.gap):  # published while A is down (or starting): A gets them by replay only
                send(ps[i])
                i += 1
            while c.services[0].pid == pid:  # the launcher's supervisor restarts it
                if time.monotonic() - t_kill > 120:
                    raise SystemExit("the supervisor did not restart the indexer in 120 s")
                time.sleep(0.2)
            up_s = wait_up(c.services[0].url)
            restart_s = time.monotonic() - t_kill
            view_a = settled(a_url)
            settled(b_url)
            workers = c.worker_urls("prefill")  # where prompts are computed (D's hits are the hand-off's)
            h0 = hits(workers)
            got_a = got_b = total = 0
            per: list[tuple[int, int]] = []
            t0 = time.monotonic()
            for _ in range(a.measure):
                p = ps[i]
                i += 1
                ha, hb = best_hit(a_url, p, workers), best_hit(b_url, p, workers)
                per.append((ha, hb))
                got_a, got_b, total = got_a + ha, got_b + hb, total + len(p)
                send(p)
            measure_s = time.monotonic() - t0
            truth = hits(workers) - h0
            final_a, final_b = settled(a_url), settled(b_url)
        finally:
            if b.poll() is None:
                os.killpg(b.pid, signal.SIGKILL)
                b.wait(10)
    ratio = got_a / got_b if got_b else float("nan")
    return {"bench": "indexer_restart", "workers": "2P1D", "routers": 2, "warm": a.warm, "gap": a.gap,
            "measure": a.measure, "prompt_tokens": total, "hit_tokens_restarted": got_a,
            "hit_tokens_never_restarted": got_b, "ratio": round(ratio, 4), "within_5pct": abs(1 - ratio) <= 0.05,
            "requests_differing": sum(1 for x, y in per if x != y),
            "vllm_prefix_cache_hits": truth, "snapshot_blocks": snap["blocks"],
            "restored_blocks": view_a["snapshot"]["restored_blocks"], "restart_s": round(restart_s, 2),
            "health_after_restart_s": round(up_s, 2), "restart_counters": view_a["counters"],
            "final_counters_restarted": final_a["counters"], "final_counters_never_restarted": final_b["counters"],
            "measure_s": round(measure_s, 1), "loadavg_start": load_start, "loadavg_end": os.getloadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm", type=int, default=60, help="requests before the snapshot")
    p.add_argument("--gap", type=int, default=8, help="requests after the snapshot, and again while A is down")
    p.add_argument("--measure", type=int, default=100, help="requests measured after the restart")
    p.add_argument("--families", type=int, default=6, help="shared prefixes in the traffic")
    p.add_argument("--seed", type=int, default=39)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-ixr-") as d:
        r = run(a, Path(d))
    print(f"| next {r['measure']} requests | prompt tokens | hit tokens (index says) | vs never restarted |")
    print("|---|---|---|---|")
    print(f"| indexer restarted (kill -9, {r['restart_s']} s down) | {r['prompt_tokens']} | "
          f"{r['hit_tokens_restarted']} | {r['ratio']:.4f} |")
    print(f"| indexer never restarted | {r['prompt_tokens']} | {r['hit_tokens_never_restarted']} | 1.0000 |")
    print(f"| the prefill workers' own prefix cache hits (vLLM's counter: where the routers placed) | | "
          f"{r['vllm_prefix_cache_hits']:.0f} | |")
    print(f"restart counters: {r['restart_counters']}")
    print(f"load average start {r['loadavg_start']}, end {r['loadavg_end']}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
