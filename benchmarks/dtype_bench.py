"""torch matmul GFLOP/s in bf16 against fp32 on this CPU, and which dtype pdserve's CPU rule picks.

    python benchmarks/dtype_bench.py [--quick] [--reps 10] [--threads N]

Shapes: square n x n products, and the two shapes a decode step of SmolLM2-135M spends its time in (a batch of
8 tokens through a 576 x 1536 MLP projection, and the 576 x 49152 LM head). Each rate is the best of ``--reps``
timed runs after one warm-up (fp32 and bf16 alternating, so other load hits both alike), on the threads torch
uses (default: the cores this process may run on). The rule
(``pdserve.dtype.choose_dtype``) reads ``/proc/cpuinfo``'s flags only: bf16 with avx512_bf16 / amx_bf16 /
amx_tile, else fp32. A ratio bf16/fp32 well below 1 on a CPU the rule calls bf16-capable (or above 1 on one it
does not) would say the rule is wrong for this machine. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.dtype import BF16_FLAGS, choose_dtype, cpu_flags, read_cpuinfo  # noqa: E402


def _cpu_model(text: str | None) -> str:
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def rates_gflops(m: int, k: int, n: int, reps: int) -> dict[str, float]:
    """Best-of-``reps`` GFLOP/s of an (m x k) @ (k x n) product in fp32 and bf16; the two dtypes alternate rep
    by rep so that other load on the cores falls on both alike."""
    import torch

    mats = {d: (torch.randn(m, k, dtype=getattr(torch, d)), torch.randn(k, n, dtype=getattr(torch, d)))
            for d in ("float32", "bfloat16")}
    for a, b in mats.values():
        a @ b  # warm-up (oneDNN picks its kernel on the first call)
    best = {d: float("inf") for d in mats}
    budget = time.perf_counter() + 30.0  # an emulated bf16 can be 100x slower: stop early, keep the best so far
    for _ in range(reps):
        for d, (a, b) in mats.items():
            t0 = time.perf_counter()
            a @ b
            best[d] = min(best[d], time.perf_counter() - t0)
        if time.perf_counter() > budget:
            break
    return {d: 2.0 * m * k * n / t / 1e9 for d, t in best.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and reps (~10 s)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: this process's cores)")
    args = ap.parse_args(argv)
    import torch

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    reps = 3 if args.quick else args.reps
    shapes = [("square 512", 512, 512, 512), ("square 1024", 1024, 1024, 1024),
              ("decode MLP 8x576x1536", 8, 576, 1536), ("LM head 8x576x49152", 8, 576, 49152)]
    if not args.quick:
        shapes.insert(2, ("square 2048", 2048, 2048, 2048))
    rows = []
    for name, m, k, n in shapes:
        r = rates_gflops(m, k, n, reps)
        fp32, bf16 = r["float32"], r["bfloat16"]
        rows.append({"shape": name, "fp32_gflops": round(fp32, 2), "bf16_gflops": round(bf16, 2),
                     "bf16_over_fp32": round(bf16 / fp32, 3)})
    text = read_cpuinfo()
    choice = choose_dtype(cpuinfo=text)
    flags = sorted(f for f in BF16_FLAGS if f in cpu_flags(text or ""))
    print(f"CPU: {_cpu_model(text)}; bf16 flags: {', '.join(flags) or 'none'}; torch {torch.__version__}, "
          f"{threads} thread(s)")
    print(f"{'shape':<24}{'fp32 GFLOP/s':>14}{'bf16 GFLOP/s':>14}{'bf16/fp32':>11}")
    for r in rows:
        print(f"{r['shape']:<24}{r['fp32_gflops']:>14.2f}{r['bf16_gflops']:>14.2f}{r['bf16_over_fp32']:>11.3f}")
    ratio = statistics.median(r["bf16_over_fp32"] for r in rows)
    faster = "bfloat16" if ratio > 1.0 else "float32"
    print(f"rule picks {choice.describe()}")
    print(f"measured: bf16/fp32 median {ratio:.3f} -> {faster} is faster here"
          + ("" if faster == choice.dtype else "  (the rule disagrees with this measurement)"))
    print(json.dumps({"cpu": _cpu_model(text), "bf16_flags": flags, "threads": threads, "torch": torch.__version__,
                      "shapes": rows, "bf16_over_fp32_median": round(ratio, 3), "measured_faster": faster,
                      "rule_dtype": choice.dtype, "rule_reason": choice.reason,
                      "rule_agrees": faster == choice.dtype}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
