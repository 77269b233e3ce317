"""Transfer engine throughput between two real processes, against memcpy in the same run.

    python benchmarks/transfer_bench.py [--quick] [--backends tcp,local] [--reps N]

Prints a table, then one JSON line with memcpy_gbps and, per backend, <backend>_gbps_<size> for the
contiguous sizes and <backend>_scatter_ratio (4096 x 64 KiB scatter-gather GB/s over contiguous
GB/s of the same total). Issue 27: per backend, a READ of 1 MiB and 16 MiB timed with and without D's checksum
check (XXH3-64 over the received bytes in 256 KiB spans, as the connector verifies a block's per-layer runs; P seals
its blocks when it learns the lease, off the read's path), interleaved in the same run:
<backend>_checksum_overhead_<size> = time(verify) / time(read) (medians; the verification runs after the read on
D's read thread), and <backend>_checksum_overhead_interleaved_<size> = time(read then verify) / time(read) - 1.
When installed, the anchors run too: Mooncake TE's TCP transport and NIXL/UCX through their own APIs
(mooncake_tcp_*, nixl_*), and pdserve's adapters over them (mooncake_adapter_*, nixl_adapter_*).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import msgpack
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pdserve.transfer import TransferConfig, TransferEngine  # noqa: E402
from pdserve.transfer.checksum import xxh3_spans  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from anchors import median_gbps, run_anchors  # noqa: E402  (Mooncake TE and NIXL, when installed)

MiB = 1 << 20
SIZES = [1 * MiB, 16 * MiB, 256 * MiB]
BLOCK = 64 * 1024
SECRET = "transfer-bench-secret"


def serve(region_bytes: int, backend: str) -> None:
    """Target process: register one region, print the descriptor, live until stdin closes."""
    engine = TransferEngine(TransferConfig(secret=SECRET, backend=backend))
    buf = np.zeros(region_bytes, dtype=np.uint8)
    engine.register("dst", buf)
    sys.stdout.buffer.write(b"DESC " + msgpack.packb(engine.segment().to_wire()).hex().encode() + b"\n")
    sys.stdout.flush()
    sys.stdin.read()
    engine.close()
    os._exit(0)  # NIXL crashes in interpreter teardown


def start_target(region_bytes: int, backend: str = "auto") -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(region_bytes), "--engine-backend", backend],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = proc.stdout.readline()
    while line and not line.startswith(b"DESC "):  # third-party engines log to stdout
        line = proc.stdout.readline()
    return proc, msgpack.unpackb(bytes.fromhex(line[5:].strip().decode()))


def measure(backends: list[str], reps: int, engine_backend: str = "auto",
            checks: dict[str, dict[str, float]] | None = None) -> dict[str, dict[str, float]]:
    """pdserve's engine between this process and a target process, for each backend named (and, into ``checks``,
    the checksum overhead of its reads)."""
    total = max(SIZES)
    proc, peer = start_target(total, engine_backend)
    engine = TransferEngine(TransferConfig(secret=SECRET, backend=engine_backend))
    src = np.random.default_rng(1).integers(0, 255, total, dtype=np.uint8)
    engine.register("src", src)
    try:
        if checks is not None:
            checks.update({b: bench_checksum(b, peer, engine, src, reps) for b in backends})
        return {b: bench_engine(b, peer, engine, SIZES, total, reps) for b in backends}
    finally:
        engine.close()
        proc.stdin.close()
        proc.wait(timeout=30)


def measure_adapter(name: str, reps: int) -> dict[str, float] | None:
    """pdserve's Mooncake or NIXL adapter, in a child process (NIXL crashes at interpreter exit)."""
    out = subprocess.run([sys.executable, __file__, "--adapter", name, "--reps", str(reps)],
                         capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ADAPTER ")]
    if not lines:
        print(f"[transfer_bench] {name} adapter not measured: {out.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("ADAPTER "):])


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    return median_gbps(nbytes, lambda: np.copyto(dst, src), reps)


def scatter_entries(total: int, seed: int = 0) -> list[tuple]:
    """4096 x 64 KiB blocks, peer offsets shuffled so no two neighbours merge."""
    n = total // BLOCK
    order = np.random.default_rng(seed).permutation(n)
    return [("src", i * BLOCK, "dst", int(j) * BLOCK, BLOCK) for i, j in enumerate(order)]


CHECK_SIZES = [1 * MiB, 16 * MiB]
SPAN = 256 * 1024


def bench_checksum(backend: str, peer: dict, engine: TransferEngine, src: np.ndarray, reps: int) -> dict[str, float]:
    """Per size: median ms of a READ, of a READ then its verification, and of the verification alone (XXH3-64 of the
    received bytes), the three alternating each repetition after warm-ups; overhead = verify / read (medians), and
    the interleaved read+verify over read - 1 as a cross-check (noisier: two transfers' jitter)."""
    import time

    out = {}
    for size in CHECK_SIZES:
        entries = [("src", 0, "dst", 0, size)]

        def read(entries: list = entries) -> None:
            engine.submit(peer, entries, "read", backend=backend).result()

        def verify(size: int = size) -> None:
            xxh3_spans(src[i:i + SPAN] for i in range(0, size, SPAN))

        times: dict[str, list[float]] = {"read": [], "both": [], "verify": []}
        steps = {"read": (read,), "both": (read, verify), "verify": (verify,)}
        for rep in range(3 + max(reps, 5) * 3):
            for name, fns in steps.items():
                t0 = time.perf_counter()
                for fn in fns:
                    fn()
                if rep >= 3:  # warm-ups
                    times[name].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) for k, v in times.items()}
        label = f"{size // MiB}MiB"
        out[label] = med["verify"] / med["read"]
        out[f"{label}_interleaved"] = med["both"] / med["read"] - 1
        out[f"{label}_read_ms"], out[f"{label}_verify_ms"] = med["read"] * 1e3, med["verify"] * 1e3
    return out


def bench_engine(backend: str, peer: dict, engine: TransferEngine, sizes: list[int], scatter_total: int,
                 reps: int) -> dict[str, float]:
    out = {}
    for size in sizes:
        entries = [("src", 0, "dst", 0, size)]
        out[f"{size // MiB}MiB"] = median_gbps(
            size, lambda e=entries: engine.submit(peer, e, backend=backend).result(), reps)
    entries = scatter_entries(scatter_total)
    out["scatter"] = median_gbps(scatter_total, lambda: engine.submit(peer, entries, backend=backend).result(), reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions; finishes within a minute")
    ap.add_argument("--backends", default="tcp,local", help="pdserve backends to measure")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions per point (default 3 quick, 7 full)")
    ap.add_argument("--no-anchors", action="store_true", help="skip Mooncake TE and NIXL")
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--engine-backend", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--adapter", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.engine_backend)
    reps = args.reps or (3 if args.quick else 7)
    if args.adapter:
        figures = measure([args.adapter], reps, engine_backend=args.adapter)[args.adapter]
        print("ADAPTER " + json.dumps(figures), flush=True)
        os._exit(0)
    rows: list[tuple[str, str, float]] = []
    result: dict[str, float] = {}
    result["memcpy_gbps"] = memcpy_gbps(max(SIZES), reps)
    rows.append(("memcpy", "256MiB", result["memcpy_gbps"]))
    checks: dict[str, dict[str, float]] = {}
    measured = measure(args.backends.split(","), reps, checks=checks)
    if not args.no_anchors:
        for name in ("mooncake", "nixl"):
            figures = measure_adapter(name, reps)
            if figures:
                measured[f"{name}_adapter"] = figures
    for backend, figures in measured.items():
        for label, gbps in figures.items():
            rows.append((backend, label, gbps))
            result[f"{backend}_gbps_{label}"] = gbps
        result[f"{backend}_scatter_ratio"] = figures["scatter"] / figures["256MiB"]
    if not args.no_anchors:
        for name, label, gbps in run_anchors(SIZES, reps):
            rows.append((name, label, gbps))
            result[f"{name}_gbps_{label}"] = gbps
    print(f"{'path':<18}{'size':>10}{'GB/s':>10}{'x memcpy':>10}")
    for name, label, gbps in rows:
        print(f"{name:<18}{label:>10}{gbps:>10.2f}{gbps / result['memcpy_gbps']:>10.2f}")
    print(f"\n{'READ + verify':<18}{'size':>10}{'read ms':>10}{'verify ms':>10}{'overhead':>10}{'interleaved':>12}")
    for backend, figures in checks.items():
        for size in CHECK_SIZES:
            label = f"{size // MiB}MiB"
            print(f"{backend:<18}{label:>10}{figures[label + '_read_ms']:>10.3f}{figures[label + '_verify_ms']:>10.3f}"
                  f"{figures[label]:>10.1%}{figures[label + '_interleaved']:>12.1%}")
            result[f"{backend}_checksum_overhead_{label}"] = figures[label]
            result[f"{backend}_checksum_overhead_interleaved_{label}"] = figures[label + "_interleaved"]
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
