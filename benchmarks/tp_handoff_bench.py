"""KV hand-off between tensor-parallel P and D workers: bytes and read time per D rank, and the hand-off, for
TP 2->2, 2->1 and 1->2 against TP 1->1 on the same prompt, in the same run.

    PYTHONPATH=. python benchmarks/tp_handoff_bench.py [--tokens 1900] [--reps 3] [--model DIR] [--mla]

Starts four vLLM CPU servers with the pdserve connector (a, b: TP=1; p2, d2: TP=2, one core per rank) on a
small random fp32 Llama (2 layers, 2 KV heads of 64), then for each pair: P computes the prompt (max_tokens=1,
do_remote_decode), D gets prompt + t1 with P's kv_transfer_params and max_tokens=1. Reported per pair (median
over reps): D's read bytes in all, the slowest rank's read ms, each rank's bytes and ms, and the hand-off = D's
request time (read + one decode step), with ratios against 1->1. D's greedy token is checked against 1->1's.
``--exact GEN``: also GEN-token greedy answers of every pair on prompts sharing a prefix against P's TP and
D's TP serving the whole request alone (no hand-off). ``--mla``: a tiny random DeepSeek-V3 instead (MLA: one latent
per token and layer, which every TP rank holds
whole; vLLM's CPU MLA backend, ``--attention-backend CPU_MLA``, block size 16).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.launch.procs import free_port, spawn, stop_children  # noqa: E402

SECRET = "tp-handoff-bench-secret"


class Server:
    def __init__(self, name: str, model: Path, tp: int, log_dir: Path, core: int, args: tuple[str, ...] = ()) -> None:
        self.name, self.tp = name, tp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        ncpu = os.cpu_count() or 1
        cores = "|".join(str((core + r) % ncpu) for r in range(tp))
        kv = {"kv_connector": "PdserveConnector", "kv_connector_module_path": "pdserve.vllm.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": {"secret": SECRET, "lease_s": 30}}
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cores,
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
               "--max-model-len", "2048", "--max-num-seqs", "4", "--dtype", "float32",
               "--kv-cache-memory-bytes", str(48 << 20), "--tensor-parallel-size", str(tp),
               "--kv-transfer-config", json.dumps(kv), *args]
        self.child = spawn(f"vllm-{name}", cmd, env=env, log_path=self.log_path, cwd=ROOT)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.child.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready; see {self.log_path}")

    def complete(self, prompt: list[int], max_tokens: int, **extra) -> tuple[dict, float]:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False,
                "return_token_ids": True, "ignore_eos": True, **extra}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        return out, time.perf_counter() - t0


def handoff(p: Server, d: Server, prompt: list[int]) -> dict:
    salt = f"s{time.monotonic_ns()}"  # no prefix-cache hit on either side; P and D in one key domain
    pr, _ = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True}, cache_salt=salt)
    t1 = pr["choices"][0]["token_ids"]
    dr, secs = d.complete(prompt + t1, 1, kv_transfer_params=pr["kv_transfer_params"], cache_salt=salt)
    stats = (dr.get("kv_transfer_params") or {}).get("pdserve") or {}
    if not stats.get("ok"):
        raise RuntimeError(f"{p.name}->{d.name}: read failed: {stats}")
    per_rank = {int(k): v for k, v in (stats.get("per_rank") or {}).items()}
    return {"bytes": stats["bytes"], "read_ms": stats["ms"], "handoff_ms": secs * 1e3,
            "per_rank": per_rank, "token": dr["choices"][0]["token_ids"]}


def exactness(servers: dict[str, Server], pairs: dict[str, tuple[str, str]], gen: int) -> dict[str, dict]:
    """Per pair, greedy answers of ``gen`` tokens through P -> D (P's first token, D the rest) on prompts sharing
    a prefix, against P's TP alone and D's TP alone (servers a: TP 1, p2: TP 2, whole requests, no hand-off)."""
    rng = random.Random(36)
    prefix = [rng.randrange(100, 49000) for _ in range(300)]
    prompts = [prefix + [rng.randrange(100, 49000) for _ in range(n)] for n in (12, 200, 500)]
    prompts.append([rng.randrange(100, 49000) for _ in range(150)])
    alone = {tp: [servers[name].complete(p, gen)[0]["choices"][0]["token_ids"] for p in prompts]
             for tp, name in ((1, "a"), (2, "p2"))}
    out: dict[str, dict] = {"plain": {"tp1_equals_tp2": sum(x == y for x, y in zip(alone[1], alone[2])),
                                      "prompts": len(prompts)}}
    for label, (pn, dn) in pairs.items():
        p, d = servers[pn], servers[dn]
        got = []
        for prompt in prompts:
            pr, _ = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
            t1 = pr["choices"][0]["token_ids"]
            dr, _ = d.complete(prompt + t1, gen - 1, kv_transfer_params=pr["kv_transfer_params"])
            if not ((dr.get("kv_transfer_params") or {}).get("pdserve") or {}).get("ok"):
                raise RuntimeError(f"{label}: D did not take P's KV: {dr.get('kv_transfer_params')}")
            got.append(t1 + dr["choices"][0]["token_ids"])
        out[label] = {"vs_p_tp": sum(g == r for g, r in zip(got, alone[p.tp])),
                      "vs_d_tp": sum(g == r for g, r in zip(got, alone[d.tp])), "prompts": len(prompts)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1900)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="", help="model folder (default: a random 2-layer Llama built here)")
    ap.add_argument("--mla", action="store_true", help="a tiny random DeepSeek-V3 (MLA + MoE) instead")
    ap.add_argument("--start-timeout", type=float, default=1200)
    ap.add_argument("--exact", type=int, default=0, metavar="GEN",
                    help="also check GEN-token greedy answers of each pair against P's and D's TP alone")
    args = ap.parse_args()
    from pdserve.launch.models import build_random_llama
    from pdserve.launch.models_mla import build_random_deepseek_v3

    work = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    build = build_random_deepseek_v3 if args.mla else build_random_llama
    model = Path(args.model) if args.model else build(work / "model")
    extra = ("--attention-backend", "CPU_MLA") if args.mla else ()
    servers = {}
    try:
        for i, (name, tp) in enumerate((("a", 1), ("b", 1), ("p2", 2), ("d2", 2))):
            servers[name] = Server(name, model, tp, work, core=i, args=extra)
        deadline = time.monotonic() + args.start_timeout
        for s in servers.values():
            s.wait_ready(deadline)
        rng = random.Random(1)
        prompt = [rng.randrange(100, 49000) for _ in range(args.tokens)]
        pairs = {"1->1": ("a", "b"), "2->2": ("p2", "d2"), "2->1": ("p2", "b"), "1->2": ("a", "d2")}
        rows: dict[str, dict] = {}
        for label, (pn, dn) in pairs.items():
            handoff(servers[pn], servers[dn], prompt)  # warm-up: connections, first-request costs
            runs = [handoff(servers[pn], servers[dn], prompt) for _ in range(args.reps)]
            ranks = sorted(runs[0]["per_rank"])
            rows[label] = {
                "bytes": runs[0]["bytes"], "token": runs[0]["token"],
                "read_ms": statistics.median(r["read_ms"] for r in runs),
                "handoff_ms": statistics.median(r["handoff_ms"] for r in runs),
                "per_rank": {rk: {"bytes": runs[0]["per_rank"][rk][0],
                                  "ms": statistics.median(r["per_rank"][rk][1] for r in runs)} for rk in ranks},
            }
        exact = exactness(servers, pairs, args.exact) if args.exact else {}
    finally:
        for s in servers.values():
            stop_children([s.child], timeout_s=30)
    base = rows["1->1"]
    print(f"prompt {args.tokens} tokens, {args.reps} reps (median); KV {base['bytes']} B per request")
    print(f"{'P->D':6} {'bytes':>10} {'read ms':>9} {'x 1->1':>7} {'hand-off ms':>12} {'x 1->1':>7}  per D rank "
          "(bytes, read ms)")
    for label, r in rows.items():
        ranks = ", ".join(f"r{k}: {v['bytes']} B {v['ms']:.1f} ms" for k, v in r["per_rank"].items())
        print(f"{label:6} {r['bytes']:>10} {r['read_ms']:>9.1f} {r['read_ms'] / base['read_ms']:>7.2f} "
              f"{r['handoff_ms']:>12.1f} {r['handoff_ms'] / base['handoff_ms']:>7.2f}  {ranks}")
    same = all(r["token"] == base["token"] for r in rows.values())
    print("D's token per pair: " + ", ".join(f"{label} {r['token']}" for label, r in rows.items()))
    out: dict = {"tokens": args.tokens, "reps": args.reps, "mla": args.mla, "same_token_as_1to1": same}
    for label, r in rows.items():
        key = label.replace("->", "to")
        out[f"{key}_bytes"] = r["bytes"]
        out[f"{key}_read_ms"] = round(r["read_ms"], 3)
        out[f"{key}_handoff_ms"] = round(r["handoff_ms"], 3)
        out[f"{key}_read_ratio"] = round(r["read_ms"] / base["read_ms"], 3)
        out[f"{key}_handoff_ratio"] = round(r["handoff_ms"] / base["handoff_ms"], 3)
        for rk, v in r["per_rank"].items():
            out[f"{key}_rank{rk}_bytes"] = v["bytes"]
            out[f"{key}_rank{rk}_ms"] = round(v["ms"], 3)
    if exact:
        print(f"greedy {args.exact}-token answers, exact / prompts: one worker TP 1 = TP 2 on "
              f"{exact['plain']['tp1_equals_tp2']}/{exact['plain']['prompts']}; " + ", ".join(
                  f"{label}: vs P's TP {e['vs_p_tp']}/{e['prompts']}, vs D's TP {e['vs_d_tp']}/{e['prompts']}"
                  for label, e in exact.items() if label != "plain"))
        out["exact"] = exact
    print(json.dumps(out))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
