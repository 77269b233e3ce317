"""Issue 40's measure: the conductor's TTFT and TPOT prediction error with recalibration on
(``--recalibration-rate 0.1``) against off (``0``, the default), on the conversation trace, in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/recalibration_bench.py [--requests 60] [--rate 1.5]

One 1P1D launch of a small random Llama (fp32, conductor policy, ``recalibration_rate`` 0.1); a second router on the
same two workers with ``--recalibration-rate 0``. The conversation trace (pdserve/bench/data), scaled to this
machine (prompts x0.1 up to 1,500 tokens, outputs x0.25 up to 24), is replayed once through each router at
``--rate`` requests/s, off first, then on (each pass with its own token ids, so neither reuses the other's prefixes;
the trace's own sharing inside a pass stays). Each request's decision record (``GET
/v1/pdserve/decisions/{X-Request-Id}``) gives the predicted and the measured TTFT and TPOT of its placement; the
error is measured / predicted. The first ``--warmup`` requests of each pass are left out (the factors start at 1 and
need 4 measurements per worker). Prints p50 and p90 of |log2(measured / predicted)| (0: exact; 1: off by 2x) and of
the ratio itself, per router, and one JSON line with the ratios on / off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.bench.traces import TraceScale, load_trace, prompt_ids, scale_rows
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig
from pdserve.launch.ports import free_port
from pdserve.launch.procs import spawn_healthy, stop_children

VOCAB = 32000


async def _one(session: aiohttp.ClientSession, url: str, ids: list[int], out: int) -> str:
    body = {"model": "m", "prompt": ids, "max_tokens": out, "temperature": 0, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.headers.get("X-Request-Id", "")


async def _pass(url: str, reqs: list[Any], seed: int, block: int) -> list[str]:
    """Replay ``reqs`` at their arrival times; the request ids, in trace order."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.monotonic()

        async def go(r: Any) -> str:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.monotonic() - t0)))
            return await _one(s, url, prompt_ids(r, block, VOCAB, seed), r.output_length)

        return list(await asyncio.gather(*(go(r) for r in reqs)))


async def _records(url: str, ids: list[str]) -> list[dict]:
    await asyncio.sleep(1.0)  # the last tickets close after their answers
    async with aiohttp.ClientSession() as s:
        out = []
        for rid in ids:
            async with s.get(f"{url}/v1/pdserve/decisions/{rid}") as r:
                if r.status == 200:
                    out.append(await r.json())
        return out


def _errors(records: list[dict], kind: str) -> list[float]:
    """measured / predicted of each first placement's ``kind`` (ttft_s or tpot_s)."""
    out = []
    for rec in records:
        for p in rec.get("placements", [])[:1]:
            m, pr = (p.get("measured") or {}).get(kind), (p.get("predicted") or {}).get(kind)
            if m and pr:
                out.append(m / pr)
    return out


def _summary(ratios: list[float]) -> dict[str, float]:
    if not ratios:
        return {"n": 0}
    abs_log = sorted(abs(math.log2(r)) for r in ratios)
    q = statistics.quantiles(abs_log, n=10) if len(abs_log) >= 10 else [abs_log[-1]] * 9
    return {"n": len(ratios), "abs_log2_p50": round(statistics.median(abs_log), 3), "abs_log2_p90": round(q[8], 3),
            "ratio_p50": round(statistics.median(ratios), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=60, help="trace requests per pass")
    ap.add_argument("--warmup", type=int, default=15, help="first requests of each pass left out of the error")
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="recal-bench-"))
    model = a.model
    if not model:
        from pdserve.launch.models import build_random_llama

        model = str(build_random_llama(tmp / "random-llama"))
    scale = TraceScale(input_scale=0.1, output_scale=0.25, max_input=1500, max_output=24, max_model_len=4096,
                       rate=a.rate)
    reqs = scale_rows(load_trace(limit=a.requests), scale)
    cfg = LauncherConfig(model=model, prefill=1, decode=1, policy="conductor", port=0, dtype="float32",
                         max_model_len=4096, served_model_name="m", pool=False, worker_timeout_s=600,
                         run_dir=str(tmp / "run"), recalibration_rate=0.1)
    rows: dict[str, dict[str, dict]] = {}
    with Cluster(cfg) as c:
        port = free_port()
        off_url = f"http://127.0.0.1:{port}"
        off = spawn_healthy("router-recal-off", [
            sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(port), "--model-dir",
            str(c.model_dir), "--served-model-name", "m", "--max-model-len", "4096", "--policy", "conductor",
            "--recalibration-rate", "0", "--prefill", *c.worker_urls("prefill"), "--decode",
            *c.worker_urls("decode")], off_url, 300, log_path=tmp / "router-recal-off.log")
        try:
            for seed, (name, url) in enumerate((("off", off_url), ("on", c.router_url)), start=1):
                ids = asyncio.run(_pass(url, reqs, seed, scale.block_tokens))
                recs = asyncio.run(_records(url, ids[a.warmup:]))
                rows[name] = {k: _summary(_errors(recs, k)) for k in ("ttft_s", "tpot_s")}
                print(f"[recal] {name}: {len(recs)} records", file=sys.stderr, flush=True)
        finally:
            stop_children([off], timeout_s=20)
    print(f"{'router':8} {'kind':6} {'n':>4} {'|log2 err| p50':>15} {'|log2 err| p90':>15} {'ratio p50':>10}")
    for name in ("off", "on"):
        for kind in ("ttft_s", "tpot_s"):
            r = rows[name][kind]
            print(f"{name:8} {kind[:4]:6} {r.get('n', 0):>4} {r.get('abs_log2_p50', '-'):>15} "
                  f"{r.get('abs_log2_p90', '-'):>15} {r.get('ratio_p50', '-'):>10}")
    ratio = {f"{k}_{q}": (round(rows["on"][k][q] / rows["off"][k][q], 3) if rows["off"][k].get(q) else None)
             for k in ("ttft_s", "tpot_s") for q in ("abs_log2_p50", "abs_log2_p90")}
    print(json.dumps({"bench": "recalibration", "requests": a.requests, "warmup": a.warmup, "rate": a.rate,
                      "rows": rows, "on_over_off": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
