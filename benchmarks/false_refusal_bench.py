"""Issue 40's measure: the share of early rejections that the measured requests beside them show would have met the
TTFT target (false refusals), on the conversation trace with a tight target.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/false_refusal_bench.py [--requests 120] [--rate 1.5] [--ttft-slo-ms 500]

One 1P1D launch of a small random Llama (fp32, conductor policy, ``--ttft-slo-ms``), the conversation trace scaled
as in ``recalibration_bench.py`` (prompts x0.1 up to 1,500 tokens, outputs x0.25 up to 24) and replayed at
``--rate`` requests/s. The router judges each early rejection by the requests it placed on the same worker within
2 s (pdserve/conductor/refusal_replay.py); after the pass the bench waits out the window and reads the verdicts from
the router's /metrics (``pdserve_conductor_refusal_verdicts_total``) and each rejection's decision record
(``replay``). Prints the counts, the share false / (false + right), the accepted requests' TTFT p50/p90 and one JSON
line. The replay is what the router itself counts; the bench adds nothing to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from pdserve.prom import families

VOCAB = 32000


async def _one(s: aiohttp.ClientSession, url: str, ids: list[int], out: int) -> dict[str, Any]:
    body = {"model": "m", "prompt": ids, "max_tokens": out, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with s.post(url + "/v1/completions", json=body) as r:
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
        return {"status": r.status, "ttft_s": first if r.status == 200 else None,
                "id": r.headers.get("X-Request-Id", "")}


async def _pass(url: str, reqs: list[Any], block: int) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.monotonic()

        async def go(r: Any) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.monotonic() - t0)))
            return await _one(s, url, prompt_ids(r, block, VOCAB, 1), r.output_length)

        return list(await asyncio.gather(*(go(r) for r in reqs)))


async def _verdicts(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for _, _, samples in families(text):
        for smp in samples:
            if smp.name == "pdserve_conductor_refusal_verdicts_total":
                key = f"{smp.labels['target']}/{smp.labels['verdict']}"
                out[key] = out.get(key, 0.0) + smp.value
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second")
    ap.add_argument("--ttft-slo-ms", type=float, default=500.0, help="the TTFT target (tight: it causes 429s)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="false-refusal-bench-"))
    model = model_or_random_llama(a.model, tmp)
    scale = cpu_scale(a.rate)
    reqs = scale_rows(load_trace(limit=a.requests), scale)
    cfg = LauncherConfig(model=model, prefill=1, decode=1, policy="conductor", port=0, dtype="float32",
                         max_model_len=4096, served_model_name="m", pool=False, worker_timeout_s=600,
                         run_dir=str(tmp / "run"), ttft_slo_ms=a.ttft_slo_ms)
    with Cluster(cfg) as c:
        res = asyncio.run(_pass(c.router_url, reqs, scale.block_tokens))
        time.sleep(3.0)  # the replay's window (2 s) after the last refusal
        verdicts = asyncio.run(_verdicts(c.router_url))
    ok = [r["ttft_s"] for r in res if r["status"] == 200 and r["ttft_s"] is not None]
    rejected = sum(1 for r in res if r["status"] == 429)
    false = sum(v for k, v in verdicts.items() if k.endswith("/false_refusal"))
    right = sum(v for k, v in verdicts.items() if k.endswith("/right"))
    unverified = sum(v for k, v in verdicts.items() if k.endswith("/unverified"))
    share = false / (false + right) if false + right else None
    q = statistics.quantiles(ok, n=10) if len(ok) >= 10 else [float("nan")] * 9
    print(f"requests {len(res)}, accepted {len(ok)} (TTFT p50 {statistics.median(ok) if ok else float('nan'):.3f} s, "
          f"p90 {q[8]:.3f} s), rejected early {rejected} (target {a.ttft_slo_ms:.0f} ms)")
    print(f"verdicts: false refusal {false:.0f}, right {right:.0f}, unverified {unverified:.0f}; "
          f"false-refusal share {('-' if share is None else f'{share:.1%}')} of the verified")
    print(json.dumps({"bench": "false_refusal", "requests": len(res), "rate": a.rate, "ttft_slo_ms": a.ttft_slo_ms,
                      "accepted": len(ok), "rejected": rejected, "verdicts": verdicts,
                      "false_refusal_share": share,
                      "accepted_ttft_p50_s": statistics.median(ok) if ok else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
