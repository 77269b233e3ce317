"""Expert parallelism through PD on CPU (issue 36): ``pdserve serve`` 1P1D with TP 2 and expert parallelism on both
pools (``--prefill-tp 2 --decode-tp 2 --prefill-ep --decode-ep``, pdserve's connector, no pool: the pool is TP=1
only) on a tiny random Qwen3-MoE in fp32 (``pdserve.launch.models_moe``), against one plain vLLM worker with the
same flags (``--tensor-parallel-size 2 --enable-expert-parallel --dtype float32``, no connector), greedy, prompts
sharing a prefix and fresh ones, token for token.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ep_exactness.py [--gen 8] [--no-ep] [--json-out FILE]

Reported: exact answers / prompts (and which differ), whether every worker logged vLLM's "Expert parallelism is
enabled", the KV bytes D read from P (the hand-offs happened), and the seconds each part took. ``--no-ep``: the same
with TP 2 alone. On CPU workers ``pdserve serve`` refuses expert parallelism (pdserve/launch/config_experts.py:
vLLM 0.32's CPU MoE kernel ignores the expert map); the run then says so and still starts the plain vLLM worker,
recording how it fails (its first forward segfaults in cpu_fused_moe.cpp). Prints a table, then one JSON line;
exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.bench.prom import scrape
from pdserve.launch import Cluster
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.launch.models_moe import build_random_qwen3_moe
from pdserve.launch.procs import free_port, spawn_healthy, stop_children

EP_LOG = "Expert parallelism is enabled"


def prompts() -> list[list[int]]:
    """Three prompts sharing a 300-token prefix, three fresh ones."""
    rnd = random.Random(364)
    prefix = [rnd.randrange(1000, 40000) for _ in range(300)]
    shared = [prefix + [rnd.randrange(1000, 40000) for _ in range(n)] for n in (20, 200, 600)]
    return shared + [[rnd.randrange(1000, 40000) for _ in range(n)] for n in (40, 400, 900)]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        return json.loads(resp.read())


def answers(url: str, gen: int) -> list[list[int]]:
    body = {"model": "m", "max_tokens": gen, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return [post(url + "/v1/completions", {**body, "prompt": p})["choices"][0]["token_ids"] for p in prompts()]


def through_pd(model: Path, root: Path, ep: bool, gen: int) -> dict[str, Any]:
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="m", run_dir=str(root / "pd"), worker_timeout_s=1200, restart=False,
                         pool=False, prefill_tp=2, decode_tp=2, prefill_ep=ep, decode_ep=ep)
    with Cluster(cfg) as c:
        d_url = c.worker_urls("decode")[0]
        out = answers(c.router_url, gen)
        read = scrape(d_url, "vllm:pdserve_kv_read_bytes").get("vllm:pdserve_kv_read_bytes_total", 0.0)
        logs = {w.name: w.log_path.read_text(errors="replace") for w in c.workers}
    return {"answers": out, "d_read_bytes": read, "ep_logged": {n: EP_LOG in t for n, t in logs.items()}}


def plain(model: Path, root: Path, ep: bool, gen: int, timeout_s: float = 1200) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--max-model-len", "2048", "--served-model-name", "m",
           "--dtype", "float32", "--tensor-parallel-size", "2", *(("--enable-expert-parallel",) if ep else ())]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    log = root / "plain.log"
    url = f"http://127.0.0.1:{port}"
    child = spawn_healthy("vllm-plain", cmd, url, timeout_s, env=env, log_path=log)
    try:
        out = answers(url, gen)
    finally:
        stop_children([child], timeout_s=30)
    return {"answers": out, "ep_logged": EP_LOG in log.read_text(errors="replace")}


def plain_failure(model: Path, root: Path, ep: bool) -> str:
    """How the plain vLLM worker with the same flags fares ("serves" or its failure and the log's crash line)."""
    try:
        plain(model, root, ep, 1)
        return "serves"
    except Exception as exc:
        log = (root / "plain.log").read_text(errors="replace").splitlines()
        crash = [line.strip() for line in log if "Segfault" in line or "cpu_fused_moe.cpp" in line][:2]
        return f"{type(exc).__name__}: {str(exc)[:120]}; log: {' / '.join(crash)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--no-ep", action="store_true", help="TP 2 without expert parallelism")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="ep-exactness-"))
    model = build_random_qwen3_moe(root / "qwen3moe")
    ep = not args.no_ep
    t0 = time.monotonic()
    try:
        pd = through_pd(model, root, ep, args.gen)
    except ConfigError as exc:  # expert parallelism on CPU workers
        print(f"pdserve serve refused: {exc}", file=sys.stderr)
        result = {"bench": "ep_exactness", "ep": ep, "refused": str(exc), "plain": plain_failure(model, root, ep)}
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return 0
    t1 = time.monotonic()
    ref = plain(model, root, ep, args.gen)
    t2 = time.monotonic()
    lens = [len(p) for p in prompts()]
    same = [a == b for a, b in zip(pd["answers"], ref["answers"])]
    print(f"| prompt tokens | 1P1D TP2{' EP' if ep else ''} = one worker TP2{' EP' if ep else ''} |")
    print("|---|---|")
    for n, s in zip(lens, same):
        print(f"| {n} | {'identical' if s else 'DIFFERS'} |")
    result = {"bench": "ep_exactness", "ep": ep, "gen": args.gen, "prompts": len(same), "exact": sum(same),
              "differ": [n for n, s in zip(lens, same) if not s], "d_read_bytes": pd["d_read_bytes"],
              "ep_logged_pd": pd["ep_logged"], "ep_logged_plain": ref["ep_logged"],
              "pd_seconds": round(t1 - t0, 1), "plain_seconds": round(t2 - t1, 1)}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
