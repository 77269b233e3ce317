"""Issue 40's measure: the conductor's TTFT and TPOT prediction error before and after recalibration, on the
conversation trace, on the same requests of one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/recalibration_bench.py [--requests 90] [--rate 1.5] [--dump F]

One 1P1D launch of a small random Llama (fp32, conductor policy, ``--recalibration-window`` 24 unless
``--recal-window`` says otherwise). The conversation trace (pdserve/bench/data), scaled to this machine (prompts x0.1
up to 1,500 tokens, outputs x0.25 up to 24), is replayed through its router at ``--rate`` requests/s. Each
request's decision record (``GET /v1/pdserve/decisions/{X-Request-Id}``) holds the measured TTFT and TPOT of its
placement, the prediction the conductor placed with (``predicted``: corrected) and, when a correction was in
force, the cost model's own (``recalibration.uncorrected``; else the two are equal). The error of each against the
measurement is the before/after pair: the same requests, the same load, the same placements, so the machine's
load from second to second (which moved two sequential passes' errors as much as the correction did, see
docs/conductor.md) cancels out. The first ``--warmup`` requests are left out (no correction yet). Prints p50 and
p90 of |log2(measured / predicted)| (0: exact; 1: off by 2x) and the median ratio, for the uncorrected ("before")
and the corrected ("after") predictions, and one JSON line with the ratios after / before. ``--dump F`` writes
every record (JSON lines) for offline study.
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

from pdserve.bench.traces import cpu_scale, load_trace, prompt_ids, scale_rows
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig
from pdserve.launch.models import model_or_random_llama

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


def _pairs(records: list[dict], kind: str) -> tuple[list[float], list[float]]:
    """measured / predicted of each first placement's ``kind`` (ttft_s or tpot_s): (uncorrected, corrected)."""
    before, after = [], []
    for rec in records:
        for p in rec.get("placements", [])[:1]:
            m, pr = (p.get("measured") or {}).get(kind), (p.get("predicted") or {}).get(kind)
            raw = ((p.get("recalibration") or {}).get("uncorrected") or {}).get(kind, pr)
            if m and pr and raw:
                before.append(m / raw)
                after.append(m / pr)
    return before, after


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
    ap.add_argument("--requests", type=int, default=90, help="trace requests replayed")
    ap.add_argument("--warmup", type=int, default=15, help="first requests left out of the error")
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second")
    ap.add_argument("--recal-window", type=int, default=24, help="the router's --recalibration-window (off by default "
                    "in pdserve; the bench turns it on)")
    ap.add_argument("--dump", default="", help="write every decision record here (JSON lines)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="recal-bench-"))
    model = model_or_random_llama(a.model, tmp)
    scale = cpu_scale(a.rate)
    reqs = scale_rows(load_trace(limit=a.requests), scale)
    cfg = LauncherConfig(model=model, prefill=1, decode=1, policy="conductor", port=0, dtype="float32",
                         max_model_len=4096, served_model_name="m", pool=False, worker_timeout_s=600,
                         run_dir=str(tmp / "run"), recalibration_window=a.recal_window)
    with Cluster(cfg) as c:
        ids = asyncio.run(_pass(c.router_url, reqs, 1, scale.block_tokens))
        recs = asyncio.run(_records(c.router_url, ids))
    print(f"[recal] {len(recs)} records of {len(ids)} requests", file=sys.stderr, flush=True)
    if a.dump:
        Path(a.dump).write_text("".join(json.dumps(r) + "\n" for r in recs))
    kept = recs[a.warmup:]
    rows: dict[str, dict[str, dict]] = {"before": {}, "after": {}}
    for kind in ("ttft_s", "tpot_s"):
        before, after = _pairs(kept, kind)
        rows["before"][kind], rows["after"][kind] = _summary(before), _summary(after)
    print(f"{'prediction':12} {'kind':6} {'n':>4} {'|log2 err| p50':>15} {'|log2 err| p90':>15} {'ratio p50':>10}")
    for name in ("before", "after"):
        for kind in ("ttft_s", "tpot_s"):
            r = rows[name][kind]
            print(f"{name:12} {kind[:4]:6} {r.get('n', 0):>4} {r.get('abs_log2_p50', '-'):>15} "
                  f"{r.get('abs_log2_p90', '-'):>15} {r.get('ratio_p50', '-'):>10}")
    ratio = {f"{k}_{q}": (round(rows["after"][k][q] / rows["before"][k][q], 3) if rows["before"][k].get(q) else None)
             for k in ("ttft_s", "tpot_s") for q in ("abs_log2_p50", "abs_log2_p90")}
    print(json.dumps({"bench": "recalibration", "requests": a.requests, "warmup": a.warmup, "rate": a.rate,
                      "recal_window": a.recal_window, "rows": rows, "after_over_before": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
