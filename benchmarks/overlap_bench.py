"""Serial vs early dispatch vs early dispatch + layer-wise KV (issue 37): the hand-off gap at the client, in one run.

    PYTHONPATH=$PWD python benchmarks/overlap_bench.py [--lengths 500,2000,8000] [--requests 8] [--output 32]
        [--bursts 6] [--burst-size 8] [--layer-batch-bytes N]

Two real 1P1D stacks through the launcher, one after the other (router, P and D vLLM CPU workers, one core each, KV
pool off, a random fp32 Llama from ``pdserve.launch.models``: ``--layers``, ``--hidden``, ``--heads``, ``--kv-heads``,
``--intermediate``; the default is small, with about 1/100 of a Llama-3-8B's forward work per KV byte): the first with
layer-wise KV on (the default), the second with ``--no-layerwise-kv``. Each stack gets more routers over the same two
workers: one started with ``--no-early-dispatch`` (the serial hand-off, that stack's baseline), one with
``--early-continue never`` (early dispatch where D regenerates P's first token and the router compares) and, on the
first stack, one with ``--early-continue always`` (D always continues after P's first token, the default before
``auto``). On each stack the requests rotate between its routers (which one goes first rotates too), one at a time,
each with its own random prompt (no prefix-cache hit on P or D), greedy, ``ignore_eos``, streamed. So one run has
seven paths: ``all`` (the defaults: early dispatch, layer-wise KV, ``--early-continue auto``, which regenerates a
greedy request's t1 where P says it sends layer by layer), ``always`` (early + layer-wise, D continues after P's t1),
``layerwise`` (early + layer-wise, D regenerates t1) and ``serial`` on the first stack; ``early_cont`` (early,
whole-prompt read: ``auto`` continues), ``early`` (early, whole-prompt read, D regenerates t1) and ``serial_off`` on
the second. Per request, at the client:

* ``ttft``: send -> the first token (P's, streamed at once on every path); P's prefill throughput is the prompt's
  tokens over it;
* ``gap``: the first token -> the second (the hand-off: D's first token);
* ``tpot``: the mean time per token after the second.

And from the connectors' logs (same host, same wall clock): D's ``hand-off {json}`` lines (matched to the request by
time) give the read (``read``: first byte to last; ``busy``: the transfer batches' own time, layer-wise reads move in
several); P's ``hand-off ready {json}`` lines give when the forward that completed the prompt ended, so ``hidden`` is
the share of the read's transfer time that was over before P's forward ended (the transfer hidden behind P's
prefill; early paths only: a serial read starts after P answered).

P busy (``--bursts`` rounds of ``--burst-size`` prompts sent at once, per length and path, the paths in rotating
order): P's prefill throughput while it has a queue (the prompts' tokens over the time from the first send to the last
first token), the measure of layer-wise sends' cost to P; one request at a time, P's TTFT also carries D's and the
router's work on the shared cores.

Each worker's CPU per request (``P cpu``, ``D cpu``: its API server and engine processes, user + system, from the send
to the last token; a mean, since the kernel counts in 10 ms ticks): on a busy P, its CPU per request is what bounds its
prefill throughput, where one request's TTFT also shows every other process on the 2 cores.

P's own cost of layer-wise sends, which the stacks' TTFTs show only through the load on a shared machine: the CPU time
P's engine threads spent answering D's layer questions (``vllm:pdserve_kv_layer_answer_seconds_total`` on P, per
request), over the serial path's TTFT p50 on the same stack (``p_answer_cpu_over_serial_ttft``). The copies
themselves cost P nothing on the same host (D copies with ``process_vm_readv``).

Prints a table (p50 / p99 ms per length and path) and the ratios (each early path over its own stack's serial;
layer-wise over early raw and normalised by each stack's serial), then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def stream(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """One streamed completion: wall-clock send time and each token's arrival."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    t_send = time.time()
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
    arrivals: list[float] = []
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            line = event.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            now = time.time()
            for c in obj.get("choices") or []:
                arrivals += [now] * len(c.get("token_ids") or []) if c.get("token_ids") else ([now] if c.get("text")
                                                                                                else [])
    conn.close()
    return {"send": t_send, "arrivals": arrivals, "end": time.time()}


def burst(url: str, bodies: list[dict[str, Any]], pids: dict[str, int]) -> dict[str, float]:
    """``bodies`` sent at once: P's prefill throughput while busy (the prompts' tokens over the time from the first
    send to the last first token) and each worker's CPU per request over the burst."""
    import concurrent.futures

    before = {k: tree_cpu_s(pid) for k, pid in pids.items()}
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        recs = list(ex.map(lambda b: stream(url, b), bodies))
    out = cpu_used(pids, before, len(bodies))
    span = max(r["arrivals"][0] for r in recs) - min(r["send"] for r in recs)
    out["tps"] = sum(len(b["prompt"]) for b in bodies) / max(span, 1e-9)
    return out


def d_stamps(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        at = line.find("hand-off {")
        if at >= 0:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[at + len("hand-off "):]))
    return out


def complete(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> list[int]:
    """One non-streamed completion's token ids (``return_token_ids``)."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps({**body, "return_token_ids": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {data[:500]!r}")
    choice = json.loads(data)["choices"][0]
    return list(choice.get("token_ids") or []) or [hash(choice.get("text"))]


def counter(url: str, name: str) -> float:
    """The sum of a Prometheus counter's series on ``url``'s /metrics."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and (line[len(name)] in " {"))


ANSWER_CPU = "vllm:pdserve_kv_layer_answer_seconds_total"


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a worker's processes (its API server and the engine below it) have used so far."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def cpu_used(pids: dict[str, int], before: dict[str, float], requests: int = 1) -> dict[str, float]:
    """The CPU ms per request each worker (``pids``: "p", "d") used since ``before`` (:func:`tree_cpu_s` of each),
    as ``{"p_cpu": .., "d_cpu": ..}``."""
    return {f"{k}_cpu": (tree_cpu_s(pid) - before[k]) * 1e3 / requests for k, pid in pids.items()}


def timed(url: str, body: dict[str, Any], pids: dict[str, int]) -> dict[str, Any]:
    """:func:`stream`, with the CPU ms each worker (``pids``: "p", "d") used from the send to the last token."""
    before = {k: tree_cpu_s(pid) for k, pid in pids.items()}
    rec = stream(url, body)
    rec.update(cpu_used(pids, before))
    return rec


def p_ready(log: Path) -> dict[str, float]:
    """Hand-off id -> when P's forward that completed its prompt ended (P's ``hand-off ready`` lines)."""
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        at = line.find("hand-off ready {")
        if at >= 0:
            with contextlib.suppress(ValueError, KeyError):
                obj = json.loads(line[at + len("hand-off ready "):])
                out[obj["handoff"]] = float(obj["t"])
    return out


def measure(rec: dict[str, Any], stamps: list[dict[str, Any]], ready: dict[str, float], n: int) -> dict[str, float]:
    a = rec["arrivals"]
    row = {"ttft": (a[0] - rec["send"]) * 1e3, "gap": (a[1] - a[0]) * 1e3,
           "tpot": (a[-1] - a[1]) / max(1, len(a) - 2) * 1e3}
    row["prefill_tps"] = n / max(a[0] - rec["send"], 1e-9)
    row.update({k: rec[k] for k in ("p_cpu", "d_cpu") if k in rec})
    mine = [s for s in stamps if rec["send"] <= (s.get("arrive") or 0) <= rec["end"]]
    if len(mine) == 1 and mine[0].get("read_start") and mine[0].get("read_end"):
        s = mine[0]
        row["read"] = (s["read_end"] - s["read_start"]) * 1e3
        spans = s.get("spans") or [[s["read_start"], s["read_end"]]]
        busy = sum(b - a0 for a0, b in spans)
        row["busy"] = busy * 1e3
        row["batches"] = len(spans)
        t_end = ready.get(str(s.get("p_req")))
        if t_end is not None and busy > 0:
            row["hidden"] = sum(max(0.0, min(b, t_end) - a0) for a0, b in spans) / busy
    return row


def second_router(model: str, name: str, max_len: int, p: str, d: str, log: Path,
                  flag: str = "--no-early-dispatch") -> tuple[Any, str]:
    from pdserve.launch.procs import free_port, spawn_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = spawn_healthy(f"router{flag.replace(' ', '=')}", [
        sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(port), "--model-dir", model,
        "--served-model-name", name, "--max-model-len", str(max_len), "--prefill", p, "--decode", d,
        *flag.split()], url, timeout_s=180, log_path=log)
    return child, url


# stack -> (layerwise_kv, {path name: the flag of its router; "" is the cluster's own router})
STACKS = {"on": (True, {"all": "", "always": "--early-continue always", "layerwise": "--early-continue never",
                        "serial": "--no-early-dispatch"}),
          "off": (False, {"early_cont": "", "early": "--early-continue never", "serial_off": "--no-early-dispatch"})}
PATHS = ("serial", "layerwise", "always", "all", "serial_off", "early", "early_cont")
KEYS = ("ttft", "gap", "tpot", "read", "busy", "hidden", "prefill_tps", "batches", "p_cpu", "d_cpu")


def run_stack(cfg: Any, model: Path, max_len: int, lengths: list[int], requests: int, output: int,
              flags: dict[str, str], rng: random.Random, tmp: Path, p_cpu: dict[int, float], exact: dict[str, bool],
              bursts: tuple[int, int], busy: dict[tuple[int, str], list[dict[str, float]]]
              ) -> dict[tuple[int, str], list[dict[str, float]]]:
    """One stack's requests, rotating between its routers (``flags``); the rows of each (length, path).
    ``p_cpu[n]``: the CPU ms per request P's engine spent answering layer questions at ``n`` tokens (layer-wise).
    ``bursts`` (rounds, requests at once): into ``busy``, each round's :func:`burst` per (length, path)."""
    from pdserve.launch import Cluster
    from pdserve.launch.procs import stop_children

    recs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    with Cluster(cfg) as c:
        p, d = c.worker_urls("prefill")[0], c.worker_urls("decode")[0]
        pids = {w.role[0]: child.pid for w, child in zip(c.plan.workers, c.workers)}  # "p", "d"
        children, routers = [], {}
        for path, flag in flags.items():
            if not flag:
                routers[path] = c.router_url
                continue
            child, routers[path] = second_router(str(model), "m", max_len, p, d, tmp / f"{path}.log", flag)
            children.append(child)
        names = list(flags)
        try:

            def body(n: int) -> dict[str, Any]:
                return {"model": "m", "max_tokens": output, "temperature": 0,
                        "ignore_eos": True, "prompt": [rng.randrange(1000, 40000) for _ in range(n)]}

            for url in routers.values():  # warm-up; the early router learns P's engine from P's first answer
                stream(url, body(64))
                stream(url, body(min(lengths)))
            for n in lengths:
                cpu0 = counter(p, ANSWER_CPU)
                for i in range(requests):
                    order = names[i % len(names):] + names[:i % len(names)]  # which goes first rotates
                    for path in order:
                        recs.setdefault((n, path), []).append(timed(routers[path], body(n), pids))
                time.sleep(1.5)  # vLLM's stats interval: the last answers' time reaches /metrics
                if cfg.layerwise_kv:
                    p_cpu[n] = (counter(p, ANSWER_CPU) - cpu0) * 1e3 / requests
                for i in range(bursts[0]):  # P busy: several prompts at once, the paths in rotating order
                    for path in names[i % len(names):] + names[:i % len(names)]:
                        busy.setdefault((n, path), []).append(
                            burst(routers[path], [body(n) for _ in range(bursts[1])], pids))
            for n in lengths:  # exactness: one prompt of each length through every path and D alone, greedy
                one = body(n)
                outs = [complete(u, one) for u in [*routers.values(), d]]
                exact[f"{names[0]}_{n}"] = all(o == outs[-1] for o in outs)
            stamps = d_stamps(Path(c.run_dir) / "decode0.log")
            ready = p_ready(Path(c.run_dir) / "prefill0.log")
        finally:
            stop_children(children)
    return {(n, path): [measure(r, stamps, ready, n) for r in rs] for (n, path), rs in recs.items()}


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    col = {k: [r[k] for r in rows if k in r] for k in KEYS}
    s = {"ttft_p50": pct(col["ttft"], .5), "gap_p50": pct(col["gap"], .5), "gap_p99": pct(col["gap"], .99),
         "tpot_p50": pct(col["tpot"], .5), "read_p50": pct(col["read"], .5), "busy_p50": pct(col["busy"], .5),
         "hidden_mean": statistics.fmean(col["hidden"]) if col["hidden"] else float("nan"),
         "batches_p50": pct(col["batches"], .5), "prefill_tps_p50": pct(col["prefill_tps"], .5),
         "joined": len(col["read"]),
         # CPU per request, a mean (the kernel counts in 10 ms ticks): what bounds a busy worker's throughput
         "p_cpu_mean": statistics.fmean(col["p_cpu"]) if col["p_cpu"] else float("nan"),
         "d_cpu_mean": statistics.fmean(col["d_cpu"]) if col["d_cpu"] else float("nan")}
    s["gap_over_tpot"] = s["gap_p50"] / s["tpot_p50"]
    return {k: round(v, 3) for k, v in s.items()}


def busy_summary(rounds: list[dict[str, float]]) -> dict[str, float]:
    tps = [r["tps"] for r in rounds]
    cpu = [r["p_cpu"] for r in rounds if "p_cpu" in r]
    return {"rounds": len(rounds), "tps_p50": round(statistics.median(tps), 1) if tps else float("nan"),
            "p_cpu_mean": round(statistics.fmean(cpu), 2) if cpu else float("nan")}


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="500,2000,8000")
    ap.add_argument("--requests", type=int, default=8, help="per length and path")
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512,
                    help="the MLP's width: with --hidden and --kv-heads, the forward's work per KV byte")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bursts", type=int, default=6, help="rounds of prompts sent at once, per length and path")
    ap.add_argument("--burst-size", type=int, default=8, help="prompts sent at once in a round")
    ap.add_argument("--layer-batch-bytes", type=int, default=None,
                    help="the connector's layer_batch_bytes on both stacks (default: the connector's own)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    max_len = max(lengths) + a.output + 64

    from pdserve.bench.compare import CompareSettings, launcher_config
    from pdserve.launch.models import build_random_llama

    tmp = Path(tempfile.mkdtemp(prefix="overlap-bench-"))
    model = build_random_llama(tmp / "model", layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                               intermediate=a.intermediate, max_position_embeddings=max(8192, max_len))
    rng = random.Random(a.seed)
    rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    t0 = time.monotonic()
    loads = []
    p_cpu: dict[int, float] = {}
    exact: dict[str, bool] = {}
    busy: dict[tuple[int, str], list[dict[str, float]]] = {}
    for stack, (layerwise, flags) in STACKS.items():
        cfg = launcher_config("1p1d", CompareSettings(model=str(model), dtype="float32", max_model_len=max_len,
                                                      run_dir=str(tmp / f"run-{stack}")))
        extra = {} if a.layer_batch_bytes is None else {"layer_batch_bytes": a.layer_batch_bytes}
        cfg = dataclasses.replace(cfg, pool=False, served_model_name="m", layerwise_kv=layerwise,
                                  connector_extra={**cfg.connector_extra, **extra})
        rows.update(run_stack(cfg, model, max_len, lengths, a.requests, a.output, flags, rng, tmp, p_cpu, exact,
                              (a.bursts, a.burst_size), busy))
        loads.append([round(x, 2) for x in os.getloadavg()])
    wall = time.monotonic() - t0
    out: dict[str, Any] = {"model": f"random llama fp32, {a.layers} layers, hidden {a.hidden}, heads {a.heads}, "
                                    f"kv heads {a.kv_heads}, intermediate {a.intermediate}", "output": a.output,
                           "layer_batch_bytes": a.layer_batch_bytes,
                           "requests": a.requests, "wall_s": round(wall, 1), "loadavg_after_each_stack": loads,
                           "exact": exact, "lengths": {}}
    print(f"{'tokens':>6} {'path':>10} | {'ttft p50':>8} {'gap p50':>8} {'gap p99':>8} {'tpot p50':>8} "
          f"{'gap/tpot':>8} {'read p50':>8} {'busy p50':>8} {'batches':>7} {'hidden':>6} {'P tok/s':>8} {'P cpu':>6} "
          f"{'D cpu':>6}")
    for n in lengths:
        per: dict[str, Any] = {}
        for path in PATHS:
            s = per[path] = summary(rows.get((n, path), []))
            print(f"{n:>6} {path:>10} | {s['ttft_p50']:8.1f} {s['gap_p50']:8.1f} {s['gap_p99']:8.1f} "
                  f"{s['tpot_p50']:8.1f} {s['gap_over_tpot']:8.2f} {s['read_p50']:8.1f} {s['busy_p50']:8.1f} "
                  f"{s['batches_p50']:7.0f} {s['hidden_mean']:6.2f} {s['prefill_tps_p50']:8.0f} {s['p_cpu_mean']:6.1f} "
                  f"{s['d_cpu_mean']:6.1f}")
        lw, se, ea, so = per["layerwise"], per["serial"], per["early"], per["serial_off"]
        al, ec, aw = per["all"], per["early_cont"], per["always"]
        per["ratios"] = {
            "gap_p50_all_over_always": ratio(al["gap_p50"], aw["gap_p50"]),
            "gap_over_tpot_always": aw["gap_over_tpot"],
            "gap_over_tpot_layerwise": lw["gap_over_tpot"],
            "gap_p50_all_over_serial": ratio(al["gap_p50"], se["gap_p50"]),
            "gap_p50_all_over_layerwise": ratio(al["gap_p50"], lw["gap_p50"]),
            "gap_p50_early_cont_over_early": ratio(ec["gap_p50"], ea["gap_p50"]),
            "gap_over_tpot_all": al["gap_over_tpot"],
            "gap_over_tpot_serial": se["gap_over_tpot"],
            "gap_p50_layerwise_over_serial": ratio(lw["gap_p50"], se["gap_p50"]),
            "gap_p50_early_over_serial_off": ratio(ea["gap_p50"], so["gap_p50"]),
            "gap_p50_layerwise_over_early": ratio(lw["gap_p50"], ea["gap_p50"]),
            "prefill_tps_layerwise_over_serial": ratio(lw["prefill_tps_p50"], se["prefill_tps_p50"]),
            "prefill_tps_early_over_serial_off": ratio(ea["prefill_tps_p50"], so["prefill_tps_p50"]),
            "prefill_tps_layerwise_over_early": ratio(lw["prefill_tps_p50"], ea["prefill_tps_p50"]),
            "prefill_tps_layerwise_over_early_normalised": ratio(
                lw["prefill_tps_p50"] / se["prefill_tps_p50"], ea["prefill_tps_p50"] / so["prefill_tps_p50"]),
            # each worker's CPU per request (P's bounds its prefill throughput when busy), over the stack's serial
            "p_cpu_all_over_serial": ratio(al["p_cpu_mean"], se["p_cpu_mean"]),
            "p_cpu_early_over_serial_off": ratio(ea["p_cpu_mean"], so["p_cpu_mean"]),
            "d_cpu_all_over_serial": ratio(al["d_cpu_mean"], se["d_cpu_mean"]),
            "d_cpu_early_over_serial_off": ratio(ea["d_cpu_mean"], so["d_cpu_mean"]),
        }
        # P's own cost of layer-wise sends, load-independent: its engine's CPU time answering D's layer questions
        # (checksums of each layer as it is written), against the serial prefill's time on the same stack
        per["p_answer_cpu_ms"] = round(p_cpu.get(n, float("nan")), 3)
        per["busy"] = {path: busy_summary(busy.get((n, path), [])) for path in PATHS}
        bz = per["busy"]
        per["ratios"].update({  # P's prefill throughput while busy, each early path over its stack's serial
            "busy_tps_all_over_serial": ratio(bz["all"]["tps_p50"], bz["serial"]["tps_p50"]),
            "busy_tps_layerwise_over_serial": ratio(bz["layerwise"]["tps_p50"], bz["serial"]["tps_p50"]),
            "busy_tps_early_over_serial_off": ratio(bz["early"]["tps_p50"], bz["serial_off"]["tps_p50"]),
            "busy_p_cpu_all_over_serial": ratio(bz["all"]["p_cpu_mean"], bz["serial"]["p_cpu_mean"]),
        })
        per["ratios"]["p_answer_cpu_over_serial_ttft"] = ratio(per["p_answer_cpu_ms"], se["ttft_p50"])
        r = per["ratios"]
        print(f"{n:>6}  gap p50 all/always {r['gap_p50_all_over_always']:.2f}, all/serial "
              f"{r['gap_p50_all_over_serial']:.2f}, all/layerwise "
              f"{r['gap_p50_all_over_layerwise']:.2f}, early_cont/early {r['gap_p50_early_cont_over_early']:.2f}; "
              f"gap/TPOT all {r['gap_over_tpot_all']:.2f}, serial {r['gap_over_tpot_serial']:.2f}")
        print(f"{n:>6}  gap p50 layerwise/serial {r['gap_p50_layerwise_over_serial']:.2f}, early/serial_off "
              f"{r['gap_p50_early_over_serial_off']:.2f}, layerwise/early {r['gap_p50_layerwise_over_early']:.2f}; "
              f"P prefill tok/s layerwise/early {r['prefill_tps_layerwise_over_early']:.3f} (normalised by each "
              f"stack's serial {r['prefill_tps_layerwise_over_early_normalised']:.3f}); P's CPU answering layer "
              f"questions {per['p_answer_cpu_ms']:.2f} ms per request = "
              f"{r['p_answer_cpu_over_serial_ttft']:.4f} of the serial TTFT p50")
        print(f"{n:>6}  CPU per request, P: all/serial {r['p_cpu_all_over_serial']:.3f}, early/serial_off "
              f"{r['p_cpu_early_over_serial_off']:.3f}; D: all/serial {r['d_cpu_all_over_serial']:.3f}, "
              f"early/serial_off {r['d_cpu_early_over_serial_off']:.3f}")
        if any(bz[path]["rounds"] for path in PATHS):
            print(f"{n:>6}  P busy ({a.burst_size} at once, {a.bursts} rounds), prefill tok/s p50 / P CPU ms per "
                  "request: " + ", ".join(f"{path} {bz[path]['tps_p50']:.0f} / {bz[path]['p_cpu_mean']:.1f}"
                                            for path in PATHS))
            print(f"{n:>6}  P busy tok/s all/serial {r['busy_tps_all_over_serial']:.3f}, layerwise/serial "
                  f"{r['busy_tps_layerwise_over_serial']:.3f}, early/serial_off "
                  f"{r['busy_tps_early_over_serial_off']:.3f}; P CPU per request all/serial "
                  f"{r['busy_p_cpu_all_over_serial']:.3f}")
        out["lengths"][str(n)] = per
    print(f"exact (the path = its serial path = D alone, token for token): {exact}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
