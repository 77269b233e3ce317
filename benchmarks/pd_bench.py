"""Disaggregated (1P1D, one core each) vs one colocated worker (both cores), in one run.

    python benchmarks/pd_bench.py [--quick] [--model DIR] [--requests N] [--output-tokens T]

For 512- and 2,048-token prompts (fresh random token ids, so no prefix-cache hits) it streams requests
through the router (one at a time, or --concurrency N at once) and reports TTFT, TPOT and ITL p50/p99 from the client's clock,
the KV transfer's share of TTFT and the router's own overhead (time in the router excluding waits on
workers) from the router's per-request timings. Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pdserve.bench.client import stream_completion  # noqa: E402
from pdserve.bench.metrics import RequestRecord, summarize  # noqa: E402
from pdserve.bench.prom import delta, scrape  # noqa: E402
from pdserve.config import LauncherConfig  # noqa: E402
from pdserve.launcher import Cluster  # noqa: E402

PROMPT_LENGTHS = (512, 2048)


def prompt_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def run_requests(url: str, model: str, length: int, n: int, out_tokens: int, seed: int,
                       concurrency: int = 1) -> tuple[list[RequestRecord], float]:
    """n requests of ``length`` fresh random tokens, ``concurrency`` client loops at a time."""
    rng = random.Random(seed)
    payloads = [{"model": model, "prompt": prompt_ids(length, rng), "max_tokens": out_tokens,
                 "temperature": 0, "ignore_eos": True} for _ in range(n)]
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession() as session:
        warm = {"model": model, "prompt": prompt_ids(length, rng), "max_tokens": 2, "temperature": 0}
        await stream_completion(session, url, warm)

        async def loop(mine: list[dict]) -> None:
            for payload in mine:
                records.append(await stream_completion(session, url, payload))

        t0 = time.monotonic()
        await asyncio.gather(*(loop(payloads[i::concurrency]) for i in range(concurrency)))
        return records, time.monotonic() - t0


def phase_stats(records: list[RequestRecord], kv: dict[str, float]) -> dict[str, Any]:
    """Router-side phase medians, and the KV reads D's connector counted during this phase
    (vLLM 0.32 leaves kv_transfer_params out of streamed answers, so they come from /metrics)."""
    timings = [r.timings for r in records if r.ok and r.timings]

    def med(key: str) -> float | None:
        vals = [t[key] for t in timings if t.get(key) is not None]
        return statistics.median(vals) if vals else None

    reads = kv.get("vllm:pdserve_kv_reads_total", 0.0)
    out = {"router_overhead_p50_ms": med("router_overhead_ms"), "prefill_p50_ms": med("prefill_ms"),
           "handoff_p50_ms": med("handoff_ms"), "kv_reads": int(reads),
           "kv_transfer_mean_ms": kv["vllm:pdserve_kv_read_seconds_sum"] * 1e3 / reads if reads else None,
           "kv_transfer_mean_bytes": kv.get("vllm:pdserve_kv_read_bytes_total", 0.0) / reads if reads else None}
    ttft = med("ttft_ms")
    out["transfer_share"] = out["kv_transfer_mean_ms"] / ttft if out["kv_transfer_mean_ms"] and ttft else None
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def kv_counters(urls: list[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for url in urls:
        for k, v in scrape(url, "vllm:pdserve_kv_").items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def bench_config(name: str, cfg: LauncherConfig, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[pd_bench] starting {name} ...", file=sys.stderr, flush=True)
    results: dict[str, Any] = {}
    with Cluster(cfg, log=lambda s: print(f"[{name}] {s}", file=sys.stderr, flush=True)) as cluster:
        decoders = cluster.worker_urls("decode")
        for length in PROMPT_LENGTHS:
            before = kv_counters(decoders)
            records, wall = asyncio.run(run_requests(cluster.router_url, cluster.model_name, length,
                                                     args.requests, args.output_tokens, seed=length,
                                                     concurrency=args.concurrency))
            kv = delta(before, kv_counters(decoders))
            errors = [r.error for r in records if not r.ok]
            if errors:
                print(f"[{name}] {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
            results[str(length)] = {**summarize(records, wall), **phase_stats(records, kv)}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 requests per prompt length, 16 output tokens")
    ap.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct, converted once)")
    ap.add_argument("--requests", type=int, default=0, help="requests per prompt length (default 12, quick 4)")
    ap.add_argument("--output-tokens", type=int, default=0, help="tokens per request (default 64, quick 16)")
    ap.add_argument("--concurrency", type=int, default=1, help="client loops sending at once (default 1)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM chunked-prefill budget for every worker (default: vLLM's)")
    args = ap.parse_args()
    args.requests = args.requests or (4 if args.quick else 12)
    args.output_tokens = args.output_tokens or (16 if args.quick else 64)
    common = dict(model=args.model, port=0, max_model_len=4096, kv_cache_gib=2,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    configs = {
        "colocated": LauncherConfig(colocated=1, cores_per_worker=2, **common),
        "pd_1p1d": LauncherConfig(prefill=1, decode=1, **common),
    }
    results = {name: bench_config(name, cfg, args) for name, cfg in configs.items()}

    cols = ["ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "transfer_share",
            "handoff_p50_ms", "router_overhead_p50_ms"]
    print(f"{'config':<11}{'prompt':>7}" + "".join(f"{c.replace('_ms', ''):>16}" for c in cols))
    for name, by_len in results.items():
        for length, row in by_len.items():
            cells = "".join(f"{'-' if row.get(c) is None else row[c]:>16}" for c in cols)
            print(f"{name:<11}{length:>7}{cells}")
    flat: dict[str, Any] = {}
    for name, by_len in results.items():
        for length, row in by_len.items():
            for key, value in row.items():
                flat[f"{name}_{length}_{key}"] = value
    for length in map(str, PROMPT_LENGTHS):
        for key in ("ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms"):
            a, b = results["pd_1p1d"][length].get(key), results["colocated"][length].get(key)
            flat[f"ratio_pd_over_colocated_{length}_{key}"] = round(a / b, 3) if a and b else None
    print(json.dumps(flat))


if __name__ == "__main__":
    main()
