"""Disaggregated (1P1D, one core each) vs one colocated worker (both cores), in one run.

    python benchmarks/pd_bench.py [--quick] [--model DIR] [--requests N] [--output-tokens T] [--concurrency C]

For 512- and 2,048-token prompts (fresh random token ids, so no prefix-cache hits) it streams requests
through the router (one at a time, or --concurrency N at once: a closed loop) and reports TTFT, TPOT and ITL
p50/p99 from the client's clock, the KV transfer's share of TTFT (decode workers' KV read counters) and the
router's own overhead (time in the router excluding waits on workers) from the router's per-request timings.
Prints a table and a final JSON line.

A thin wrapper over ``pdserve bench`` (pdserve/bench): the same as
``pdserve bench compare --configs colocated1,1p1d --workload fixed:requests=N,input=L,output=T,concurrency=C``
for each prompt length; use that command for traces, rate sweeps, goodput and the Markdown/PNG report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pdserve.bench.compare import CompareSettings, WorkloadPlan, launcher_config, run_on_cluster  # noqa: E402
from pdserve.bench.metrics import SLO  # noqa: E402
from pdserve.launcher import Cluster  # noqa: E402

PROMPT_LENGTHS = (512, 2048)
CONFIGS = {"colocated": "colocated1", "pd_1p1d": "1p1d"}


def bench_config(name: str, settings: CompareSettings, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[pd_bench] starting {name} ...", file=sys.stderr, flush=True)
    plans = [WorkloadPlan(str(length), f"fixed:requests={args.requests},input={length},output={args.output_tokens},"
                                       f"concurrency={args.concurrency},rate=1000", {"seed": length})
             for length in PROMPT_LENGTHS]
    cfg = launcher_config(CONFIGS[name], settings)
    with Cluster(cfg, log=lambda s: print(f"[{name}] {s}", file=sys.stderr, flush=True)) as cluster:
        results = run_on_cluster(cluster, plans, SLO(), {"progress": False},
                                 max_model_len=settings.max_model_len)
    for length, row in results.items():
        if row.get("errors"):
            print(f"[{name}] {length}: {row['errors']} errors, first: {row.get('first_error')}", file=sys.stderr)
        row["transfer_share"] = row.get("kv_read_share_of_ttft_p50")
        row.pop("workload_info", None)
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
    settings = CompareSettings(model=args.model, max_model_len=4096, kv_cache_gib=2,
                               max_num_batched_tokens=args.max_num_batched_tokens)
    results = {name: bench_config(name, settings, args) for name in CONFIGS}

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
                if not isinstance(value, dict):
                    flat[f"{name}_{length}_{key}"] = value
    for length in map(str, PROMPT_LENGTHS):
        for key in ("ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms"):
            a, b = results["pd_1p1d"][length].get(key), results["colocated"][length].get(key)
            flat[f"ratio_pd_over_colocated_{length}_{key}"] = round(a / b, 3) if a and b else None
    print(json.dumps(flat))


if __name__ == "__main__":
    main()
