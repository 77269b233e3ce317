"""Transfer engine throughput between two real processes, against memcpy in the same run.

    python benchmarks/transfer_bench.py [--quick] [--backends tcp,local] [--reps N]

Prints a table, then one JSON line with memcpy_gbps and, per backend, <backend>_gbps_<size> for the
contiguous sizes and <backend>_scatter_ratio (4096 x 64 KiB scatter-gather GB/s over contiguous
GB/s of the same total). Issue 27: per backend, a READ of 1 MiB and 16 MiB of KV blocks (128 KiB blocks of two
64 KiB runs, as a layer's K and V planes) ending in D's notification to P, as the connector reads, three ways
interleaved in the same run (medians): ``off`` (kv_checksum off: P answers nothing); ``on``, the connector's way
(pdserve.vllm.integrity's ReadVerifier: P answers with the checksums it sealed off the read's path; D hashes each
frame as it lands for reads of 2 MiB or more, after the read below that, and compares); ``streamed`` (hashed as
frames land at every size) and ``after`` (hashed after the read at every size).
<backend>_checksum_overhead_<size> = time(on) / time(off) - 1; ..._streamed_<size> and ..._after_<size> alike;
<backend>_checksum_cpu_ms_<size>_<way>: the median CPU time of this (D's) process per read, all threads, each way:
on two busy cores a hash that no idle core can take shows in the wall time at about this cost.
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
from pdserve.vllm.integrity import BlockSums, ReadVerifier, SealTable  # noqa: E402
from pdserve.vllm.params import LayerGeometry  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from anchors import median_gbps, run_anchors  # noqa: E402  (Mooncake TE and NIXL, when installed)

MiB = 1 << 20
SIZES = [1 * MiB, 16 * MiB, 256 * MiB]
BLOCK = 64 * 1024
SECRET = "transfer-bench-secret"


def serve(region_bytes: int, backend: str) -> None:
    """Target process: register one region, print the descriptor, live until stdin closes."""
    engine = TransferEngine(TransferConfig(secret=SECRET, backend=backend))
    buf = np.random.default_rng(2).integers(0, 255, region_bytes, dtype=np.uint8)
    engine.register("dst", buf)
    sums, seals = kv_sums("dst", buf), SealTable()
    for size in CHECK_SIZES:  # P sealed these leases (as the connector does the step after prefill)
        seals.seal(f"on-{size}", range(size // KV_BLOCK), sums.sums)
    engine.on_notify(lambda note: seals.reply(note.message.decode() if isinstance(note.message, bytes)
                                              else note.message, sums.alg, FP) if note.message != "off" else None)
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
KV_BLOCK, KV_RUN = 128 * 1024, 64 * 1024
FP = 12345  # the fingerprint digest both sides share


def kv_sums(region: str, mem: np.ndarray) -> BlockSums:
    """Checksums over ``mem`` seen as KV blocks of one layer: blocks of two runs (K's and V's halves)."""
    return BlockSums([LayerGeometry(region, KV_BLOCK, KV_BLOCK, ((0, KV_RUN), (KV_RUN, KV_RUN)))], {region: mem})


def bench_checksum(backend: str, peer: dict, engine: TransferEngine, src: np.ndarray, reps: int) -> dict[str, float]:
    """Per size: median ms of a READ + notification without checksums (``off``), with D hashing frames as they
    land and comparing with P's answer (``on``), and with D hashing after the read (``after``), alternating each
    repetition after warm-ups."""
    sums = kv_sums("src", src)
    out = {}
    for size in CHECK_SIZES:
        med, cpu = time_checks(backend, peer, engine, sums, size, reps)
        label = f"{size // MiB}MiB"
        out[label] = med["on"] / med["off"] - 1
        for k, v in med.items():
            out[f"{label}_{k}_ms"] = v * 1e3
            out[f"{label}_{k}"] = v / med["off"] - 1
            out[f"{label}_{k}_cpu_ms"] = cpu[k] * 1e3
    return out


def time_checks(backend: str, peer: dict, engine: TransferEngine, sums: BlockSums, size: int,
                reps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per way: wall time, and this process's CPU time."""
    import time

    blocks = list(range(size // KV_BLOCK))
    entries = [("src", b * KV_BLOCK + off, "dst", b * KV_BLOCK + off, n) for b in blocks for off, n in
               ((0, KV_RUN), (KV_RUN, KV_RUN))]

    def off() -> None:
        engine.submit(peer, entries, "read", notify="off", backend=backend).result()

    def check(verifier: ReadVerifier) -> None:
        tap = verifier.tap(sums, blocks)
        handle = engine.submit(peer, entries, "read", notify=f"on-{size}", backend=backend,
                               on_frame=tap.frame if tap else None)
        handle.result()
        verifier.verify(sums, FP, handle.reply, blocks, blocks, tap, "bench", {})

    ways = {"on": ReadVerifier(), "streamed": ReadVerifier(min_bytes=0), "after": ReadVerifier(min_bytes=1 << 62)}
    steps = {"off": off, **{name: (lambda v=v: check(v)) for name, v in ways.items()}}
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpus: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(3 + max(reps, 5) * 4):
        for name, fn in steps.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            if rep >= 3:  # warm-ups
                times[name].append(time.perf_counter() - t0)
                cpus[name].append(time.process_time() - c0)
    return ({k: float(np.median(v)) for k, v in times.items()}, {k: float(np.median(v)) for k, v in cpus.items()})


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
    ways = ("on", "streamed", "after")
    print(f"\n{'READ + notify':<18}{'size':>10}{'off ms':>10}" + "".join(f"{w + ' ms':>12}" for w in ways)
          + "".join(f"{w:>10}" for w in ways) + "   D cpu ms: off / " + " / ".join(ways))
    for backend, figures in checks.items():
        for size in CHECK_SIZES:
            label = f"{size // MiB}MiB"
            print(f"{backend:<18}{label:>10}{figures[label + '_off_ms']:>10.3f}"
                  + "".join(f"{figures[f'{label}_{w}_ms']:>12.3f}" for w in ways)
                  + "".join(f"{figures[f'{label}_{w}']:>10.1%}" for w in ways)
                  + "   " + " / ".join(f"{figures[f'{label}_{w}_cpu_ms']:.3f}" for w in ("off", *ways)))
            result[f"{backend}_checksum_overhead_{label}"] = figures[label]
            for w in ways[1:]:
                result[f"{backend}_checksum_overhead_{w}_{label}"] = figures[f"{label}_{w}"]
            for w in ("off", *ways):
                result[f"{backend}_checksum_cpu_ms_{label}_{w}"] = figures[f"{label}_{w}_cpu_ms"]
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
