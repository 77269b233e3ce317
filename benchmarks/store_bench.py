"""KV pool get throughput (GB/s) from the host-memory tier and the SSD tier, against memcpy in the same run.

    python benchmarks/store_bench.py [--quick] [--object-mib 2] [--batch-mib 64] [--reps 5]

Starts a real master and store node (``pdserve store ...``) per tier; this process is the client: it puts
objects from a registered buffer and gets them back into another, one batched ``get_into`` per
``--batch-mib``. host-memory tier: objects sit in the node's arena. SSD tier: the arena is small, the objects
were spilled to files, and their pages were dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before
each timed get, so every get reads the disk, promotes into the arena, and then transfers. Prints a table and
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.launch.procs import free_port  # noqa: E402
from pdserve.store import ClientConfig, StoreClient  # noqa: E402
from pdserve.transfer import TransferConfig, TransferEngine  # noqa: E402

MiB = 1 << 20
SECRET = "store-bench-secret-0123"


def start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_TRANSFER_SECRET=SECRET)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.store.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    if not proc.stdout.readline():
        raise SystemExit(f"pdserve store {args[0]} failed to start")
    return proc


def drop_page_cache(directory: Path) -> int:
    n = 0
    for p in directory.glob("*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def run_tier(tier: str, obj: int, batch: int, total: int, reps: int, engine: TransferEngine, src: np.ndarray,
             dst: np.ndarray, tmp: Path) -> dict[str, float]:
    port = free_port()
    mem = total * 2 if tier == "mem" else max(batch * 2, 16 * MiB)
    procs = [start("master", "--port", str(port), "--high-watermark", "0.9", "--low-watermark", "0.6")]
    disk = tmp / tier
    try:
        procs.append(start("node", "--master", f"127.0.0.1:{port}", "--mem", str(mem), "--disk-dir", str(disk),
                           "--disk", str(total * 3), "--heartbeat-s", "0.2"))
        client = StoreClient(ClientConfig("127.0.0.1", port, secret=SECRET, transfer_deadline_s=60,
                                          timeout_s=120), engine)
        while client.stats()["nodes"] < 1:
            time.sleep(0.05)
        n = total // obj
        keys = list(range(1, n + 1))
        per_batch = batch // obj
        t0 = time.perf_counter()
        for i in range(0, n, per_batch):
            chunk = keys[i:i + per_batch]
            res = client.put([(k, [("src", (k - 1) * obj, obj)]) for k in chunk])
            if tier == "ssd":
                time.sleep(0.3)  # let the master spill what the next batch needs room for
            assert all(r == "stored" for r in res), res
        put_s = time.perf_counter() - t0
        if tier == "ssd":
            deadline = time.time() + 60
            while client.stats()["objects_ssd"] < n - (mem // obj):
                assert time.time() < deadline, client.stats()
                time.sleep(0.1)
        times = []
        ssd_keys = [k for k in keys]
        for rep in range(reps + 1):
            if tier == "ssd":
                # the oldest objects are on SSD only; evict promoted copies by waiting for the watermark pass
                st = client.stats()
                cand = ssd_keys[:per_batch]
                ssd_keys = ssd_keys[per_batch:] + cand
                drop_page_cache(disk)
            else:
                cand = keys[(rep * per_batch) % n:][:per_batch]
            dst[:len(cand) * obj] = 0
            t0 = time.perf_counter()
            got = client.get_into([(k, [("dst", j * obj, obj)]) for j, k in enumerate(cand)])
            dt = time.perf_counter() - t0
            assert all(got), f"{tier}: {got.count(False)} of {len(got)} objects missing"
            for j, k in enumerate(cand[:4]):
                assert np.array_equal(dst[j * obj:(j + 1) * obj], src[(k - 1) * obj:k * obj]), "corrupt object"
            if rep:
                times.append(len(cand) * obj / dt / 1e9)
            if tier == "ssd":
                time.sleep(0.5)
        st = client.stats()
        client.close()
        return {"get_gbps": statistics.median(times), "put_gbps": total / put_s / 1e9,
                "promotes": st["promotes"], "spills": st["spills"]}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB per tier, 3 reps")
    ap.add_argument("--object-mib", type=float, default=2.0, help="object size (a KV block of a large model)")
    ap.add_argument("--batch-mib", type=int, default=64, help="bytes per get_into call")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes stored per tier")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiers", default="mem,ssd")
    args = ap.parse_args()
    total = (64 if args.quick else args.total_mib) * MiB
    batch = min(args.batch_mib * MiB, total // 2 if args.quick else total)
    reps = 3 if args.quick else args.reps
    obj = int(args.object_mib * MiB)
    engine = TransferEngine(TransferConfig(secret=SECRET))
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    engine.register("src", src)
    engine.register("dst", dst)
    t = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        np.copyto(dst[:batch], src[:batch])
        t.append(batch / (time.perf_counter() - t0) / 1e9)
    memcpy = statistics.median(t[1:])
    out: dict[str, float] = {"memcpy_gbps": round(memcpy, 3), "object_bytes": obj, "batch_bytes": batch}
    rows = [("memcpy (same process)", memcpy, "", 1.0)]
    with tempfile.TemporaryDirectory(prefix="store-bench-", dir=os.environ.get("PDSERVE_BENCH_DIR")) as tmp:
        for tier in args.tiers.split(","):
            r = run_tier(tier, obj, batch, total, reps, engine, src, dst, Path(tmp))
            out[f"{tier}_get_gbps"] = round(r["get_gbps"], 3)
            out[f"{tier}_get_vs_memcpy"] = round(r["get_gbps"] / memcpy, 3)
            put = "-"  # SSD-tier puts are paced to let spills run: not a throughput
            if tier == "mem":
                out["mem_put_gbps"] = round(r["put_gbps"], 3)
                put = f"{r['put_gbps']:.2f}"
            rows.append((f"pool get, {tier} tier", r["get_gbps"], put, r["get_gbps"] / memcpy))
    engine.close()
    print(f"objects {obj / MiB:g} MiB, {batch // MiB} MiB per get_into, {total // MiB} MiB stored per tier")
    print(f"{'path':<26}{'get GB/s':>10}{'put GB/s':>10}{'x memcpy':>10}")
    for name, gbps, put, ratio in rows:
        print(f"{name:<26}{gbps:>10.2f}{put:>10}{ratio:>10.2f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
