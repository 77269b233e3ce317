"""Fixed cost per transfer batch (issue 37): pdserve's engine against NIXL and memcpy, interleaved rep by rep.

    python benchmarks/batch_cost_bench.py [--reps 60] [--before DIR] [--backends local,tcp]

Each path runs in a worker process of its own (pdserve's against a target process of the same tree, NIXL/UCX
against a NIXL target, as benchmarks/anchors.py drives it) and moves one WRITE batch per command; the coordinator
asks every path for one batch in turn, round after round, so load on a shared machine falls on all paths alike.
Batches: 1 MiB and 16 MiB contiguous, and 1 MiB as 256 scattered 4 KiB blocks (a short prompt's hand-off: many
small ranges that do not merge). memcpy: numpy's copy of the same bytes in the coordinator. ``--before DIR``: a
second pdserve tree (e.g. ``git archive <commit> pdserve benchmarks | tar -x -C DIR``), measured the same way, so
one run gives before, after, NIXL and memcpy. Prints a table (median GB/s, x NIXL, x memcpy) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20
CASES = [("1MiB", MiB, 1), ("16MiB", 16 * MiB, 1), ("1MiB_256x4KiB", MiB, 256)]
REGION = 64 * MiB
HERE = os.path.dirname(os.path.abspath(__file__))


def entries(size: int, blocks: int) -> list[tuple[int, int, int]]:
    """(local offset, peer offset, length) rows; several blocks land in reverse order, so none merge."""
    n = size // blocks
    return [(i * n, (blocks - 1 - i) * 2 * n, n) for i in range(blocks)]


def pdserve_worker(root: str, backend: str) -> tuple[object, object]:
    sys.path.insert(0, root)
    from pdserve.transfer import TransferConfig, TransferEngine

    proc = subprocess.Popen([sys.executable, os.path.join(root, "benchmarks", "transfer_bench.py"), "--serve",
                             str(REGION), "--engine-backend", "auto"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = proc.stdout.readline()
    while line and not line.startswith(b"DESC "):
        line = proc.stdout.readline()
    import msgpack

    peer = msgpack.unpackb(bytes.fromhex(line[5:].strip().decode()))
    engine = TransferEngine(TransferConfig(secret="transfer-bench-secret"))
    src = np.random.default_rng(1).integers(0, 255, REGION, dtype=np.uint8)
    engine.register("src", src)
    from pdserve.transfer.descriptor import SegmentDescriptor

    seg = SegmentDescriptor.from_wire(peer)

    def once(size: int, blocks: int) -> None:
        rows = [("src", lo, "dst", po, n) for lo, po, n in entries(size, blocks)]
        engine.submit(seg, rows, "write", backend=backend).result()

    return once, (engine, src, proc)


def nixl_worker() -> tuple[object, object]:
    import multiprocessing as mp

    sys.path.insert(0, HERE)
    from anchors import _nixl_agent, _nixl_target, nixl_write

    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    target = ctx.Process(target=_nixl_target, args=(t_child, REGION), daemon=True)
    target.start()
    metadata, raddr = t_conn.recv()
    agent = _nixl_agent("batch-cost-initiator")
    remote = agent.add_remote_agent(metadata)
    src = np.ones(REGION, dtype=np.uint8)
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    base = src.ctypes.data

    def once(size: int, blocks: int) -> None:
        rows = entries(size, blocks)
        nixl_write(agent, [(base + lo, n, 0) for lo, _, n in rows], [(raddr + po, n, 0) for _, po, n in rows], remote)

    return once, (agent, src, target, t_conn)


def serve_commands(kind: str, root: str) -> None:
    """Worker: set up, print READY, then time one batch per "SIZE BLOCKS" line."""
    once, keep = nixl_worker() if kind == "nixl" else pdserve_worker(root, kind)
    print("READY", flush=True)
    for line in sys.stdin:
        size, blocks = (int(x) for x in line.split())
        t0 = time.perf_counter()
        once(size, blocks)
        print(time.perf_counter() - t0, flush=True)
    os._exit(0)  # NIXL crashes in interpreter teardown


class Worker:
    def __init__(self, name: str, kind: str, root: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", kind, "--root", root],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        while line and line.strip() != "READY":
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{name}: worker did not start")

    def batch(self, size: int, blocks: int) -> float:
        self.proc.stdin.write(f"{size} {blocks}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def nixl_importable() -> bool:
    code = "import os\ntry:\n    from nixl._api import nixl_agent\nexcept Exception:\n    os._exit(1)\nos._exit(0)"
    return subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=60, help="rounds (every path moves each batch once per round)")
    ap.add_argument("--backends", default="local,tcp", help="pdserve backends to measure")
    ap.add_argument("--before", default="", help="a second pdserve tree to measure as 'before'")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--root", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return serve_commands(args.worker, args.root)
    root = os.path.dirname(HERE)
    specs = [(f"{b}", b, root) for b in args.backends.split(",")]
    if args.before:
        specs += [(f"{b}_before", b, os.path.abspath(args.before)) for b in args.backends.split(",")]
    if nixl_importable():
        specs.append(("nixl", "nixl", root))
    workers = [Worker(*spec) for spec in specs]
    src, dst = np.ones(16 * MiB, dtype=np.uint8), np.zeros(16 * MiB, dtype=np.uint8)
    times: dict[tuple[str, str], list[float]] = {}
    load0 = os.getloadavg()[0]
    try:
        for rep in range(3 + args.reps):
            for label, size, blocks in CASES:
                order = workers[rep % len(workers):] + workers[: rep % len(workers)]
                for w in order:
                    secs = w.batch(size, blocks)
                    if rep >= 3:
                        times.setdefault((w.name, label), []).append(secs)
                t0 = time.perf_counter()
                np.copyto(dst[:size], src[:size])
                if rep >= 3:
                    times.setdefault(("memcpy", label), []).append(time.perf_counter() - t0)
    finally:
        for w in workers:
            w.close()
    sizes = {label: size for label, size, _ in CASES}
    gbps = {k: sizes[k[1]] / statistics.median(v) / 1e9 for k, v in times.items()}
    names = [w.name for w in workers] + ["memcpy"]
    result: dict[str, float] = {"load1_start": load0, "load1_end": os.getloadavg()[0], "reps": args.reps}
    print(f"{'path':<14}{'batch':>15}{'GB/s':>9}{'med us':>9}{'x nixl':>9}{'x memcpy':>10}")
    for label, _, _ in CASES:
        for name in names:
            g = gbps[(name, label)]
            nixl = gbps.get(("nixl", label))
            result[f"{name}_gbps_{label}"] = round(g, 3)
            if nixl:
                result[f"{name}_x_nixl_{label}"] = round(g / nixl, 3)
            result[f"{name}_x_memcpy_{label}"] = round(g / gbps[("memcpy", label)], 3)
            print(f"{name:<14}{label:>15}{g:>9.2f}{statistics.median(times[(name, label)]) * 1e6:>9.0f}"
                  f"{(g / nixl if nixl else float('nan')):>9.2f}{g / gbps[('memcpy', label)]:>10.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
