"""Disaggregated (1P1D, one core each) vs one colocated worker (both cores), in one run.

    python benchmarks/pd_bench.py [--quick] [--model DIR] [--requests N] [--output-tokens T] [--concurrency C]

For 512- and 2,048-token prompts (fresh random token ids, so no prefix-cache hits) it streams requests
through the router (one at a time, or --concurrency N at once: a closed loop) and reports TTFT, TPOT and ITL
p50/p99 from the client's clock, the KV transfer's share of TTFT (decode workers' KV read counters) and the
router's own overhead (time in the router excluding waits on workers) from the router's per-request timings.
Prints a table and a final JSON line.

``--checksum-ab`` (issue 27) adds a third stack, 1P1D with ``kv_checksum: false``, in the same run, and reports
``ratio_checksum_on_over_off_<len>_ttft_p50_ms`` (1P1D with KV checksums, the default, over the same without).
``--checksum-only`` runs just the two 1P1D stacks.

A thin wrapper over ``pdserve bench`` (pdserve/bench): the same as
``pdserve bench compare --configs colocated1,1p1d --workload fixed:requests=N,input=L,output=T,concurrency=C``
for each prompt length; use that command for traces, rate sweeps, goodput and the Markdown/PNG report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pdserve.bench.compare import CompareSettings, WorkloadPlan, launcher_config, run_on_cluster  # noqa: E402
from pdserve.bench.metrics import SLO  # noqa: E402
from pdserve.launch import Cluster  # noqa: E402

PROMPT_LENGTHS = (512, 2048)
CONFIGS = {"colocated": "colocated1", "pd_1p1d": "1p1d"}


NO_CHECKSUM = "pd_1p1d_nosum"


def bench_config(name: str, settings: CompareSettings, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[pd_bench] starting {name} ...", file=sys.stderr, flush=True)
    plans = [WorkloadPlan(str(length), f"fixed:requests={args.requests},input={length},output={args.output_tokens},"
                                       f"concurrency={args.concurrency},rate=1000", {"seed": length})
             for length in PROMPT_LENGTHS]
    cfg = launcher_config(CONFIGS.get(name, "1p1d"), settings)
    if name == NO_CHECKSUM:
        cfg = dataclasses.replace(cfg, connector_extra={**cfg.connector_extra, "kv_checksum": False})
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
    ap.add_argument("--checksum-ab", action="store_true", help="also 1P1D with KV checksums off (issue 27)")
    ap.add_argument("--checksum-only", action="store_true", help="only 1P1D with KV checksums on and off")
    args = ap.parse_args()
    args.requests = args.requests or (4 if args.quick else 12)
    args.output_tokens = args.output_tokens or (16 if args.quick else 64)
    settings = CompareSettings(model=args.model, max_model_len=4096, kv_cache_gib=2,
                               max_num_batched_tokens=args.max_num_batched_tokens)
    names = list(CONFIGS) + ([NO_CHECKSUM] if args.checksum_ab or args.checksum_only else [])
    if args.checksum_only:
        names = ["pd_1p1d", NO_CHECKSUM]
    results = {name: bench_config(name, settings, args) for name in names}

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
    pairs = [("pd_1p1d", "colocated", "pd_over_colocated"), ("pd_1p1d", NO_CHECKSUM, "checksum_on_over_off")]
    for length in map(str, PROMPT_LENGTHS):
        for num, den, label in pairs:
            if num not in results or den not in results:
                continue
            for key in ("ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms"):
                a, b = results[num][length].get(key), results[den][length].get(key)
                flat[f"ratio_{label}_{length}_{key}"] = round(a / b, 3) if a and b else None
    print(json.dumps(flat))


if __name__ == "__main__":
    main()
