"""CUDA memory through pdserve's transfer engine: byte-exact checks and GB/s on one GPU host.

    python benchmarks/gpu_transfer_check.py [--reps N] [--blocks N]

Two spawned processes (owner and initiator), both on cuda:0 unless --owner-device says otherwise. Regions
shaped like vLLM's GPU KV caches: FlashAttention NHD [2, num_blocks, block_size, heads, head_dim], FlashInfer
HND [num_blocks, 2, heads, block_size, head_dim] (a permuted view), and K and V as separate tensors. For
every backend available (tcp: pinned staging; local: CUDA IPC; nixl: VRAM over UCX; mooncake: cuda:N, each
skipped with its reason when it cannot run): scattered-block READ and WRITE checked byte for byte, bytes
outside the blocks checked untouched; then READ GB/s at 16 MiB, 256 MiB and 4096 x 64 KiB against torch's
device-to-device copy and pinned device-to-host copy in the same run. Issue 27's checksum row: the connector's
device checksum (wsum32, one batched torch reduction per K/V plane over every block) on each layout: equal to the
same reduction over a host copy of the bytes, a flipped byte changes exactly its block's sum, and its GB/s over the
nhd cache (16 MiB) against the device-to-device copy. Issue 37's fence row: pdserve.vllm.fence runs an update
given after queued kernels only once they ran, without blocking the thread that gave it. Prints a table, then one
JSON line.
Needs PyTorch only (NIXL and Mooncake optional); without CUDA it prints that nothing ran and exits 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any

import msgpack

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MiB, KiB = 1 << 20, 1 << 10
SECRET = "gpu-transfer-check-secret"
NB, BS, H, D = 256, 16, 8, 128  # blocks, block size, kv heads, head dim (bf16: 32 KiB per K or V block)
BLK = BS * H * D * 2
BW_BYTES = 256 * MiB  # the 256 MiB point and 4096 x 64 KiB
SCATTER = 64 * KiB


def cuda_ready() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as exc:
        return False, f"torch not importable ({exc})"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    return True, torch.cuda.get_device_name(0)


def optional_backends() -> dict[str, str | None]:
    """Backend name -> None when usable, else why it is skipped."""
    out: dict[str, str | None] = {}
    try:
        import nixl._api  # noqa: F401
        out["nixl"] = None
    except Exception as exc:  # ImportError, or a broken wheel
        out["nixl"] = f"nixl not importable: {exc}"
    try:
        import mooncake.engine  # noqa: F401

        from pdserve.transfer.mooncake import cuda_build
        out["mooncake"] = None if cuda_build() else "installed Mooncake TE is the non-CUDA build"
    except Exception as exc:
        out["mooncake"] = f"mooncake not importable: {exc}"
    return out


# ---- memory: layouts and patterns ----
def make_layouts(device: Any) -> dict[str, Any]:
    """Region name -> tensor, for every layout (zeros)."""
    import torch
    bf = torch.bfloat16
    return {
        "nhd": torch.zeros(2, NB, BS, H, D, dtype=bf, device=device),
        "hnd": torch.zeros(NB, 2, BS, H, D, dtype=bf, device=device).permute(0, 1, 3, 2, 4),
        "k": torch.zeros(NB, BS, H, D, dtype=bf, device=device),
        "v": torch.zeros(NB, BS, H, D, dtype=bf, device=device),
    }


LAYOUTS = {"nhd": ["nhd"], "hnd": ["hnd"], "split": ["k", "v"]}


def block_spans(layout: str, b: int) -> list[tuple[str, int, int]]:
    """(region, byte offset, length) of block b's K and V in memory order."""
    if layout == "nhd":
        return [("nhd", b * BLK, BLK), ("nhd", (NB + b) * BLK, BLK)]
    if layout == "hnd":
        return [("hnd", b * 2 * BLK, 2 * BLK)]
    return [("k", b * BLK, BLK), ("v", b * BLK, BLK)]


def pattern(n: int, seed: int, device: Any) -> Any:
    import torch
    out = torch.empty(n, dtype=torch.uint8, device=device)
    step = 1 << 24  # bounded int64 scratch
    for start in range(0, n, step):
        x = torch.arange(start, min(n, start + step), dtype=torch.int64, device=device)
        out[start : start + x.numel()] = ((x * 2654435761 + seed * 40503) % 251).to(torch.uint8)
    return out


REGION_CODES = {"nhd": 0, "hnd": 1, "k": 2, "v": 3, "bw": 4}


def region_pattern(name: str, n: int, seed: int, device: Any) -> Any:
    """Region ``name``'s bytes for ``seed``: the same in every process and every subset of regions."""
    return pattern(n, seed * 16 + REGION_CODES[name], device)


def fill(tensors: dict[str, Any], seed: int) -> None:
    from pdserve.transfer.regions import byte_tensor
    for name, t in tensors.items():
        flat = byte_tensor(t)
        flat.copy_(region_pattern(name, flat.numel(), seed, flat.device))


def expected_after(tensors: dict[str, Any], base_seed: int | None, moved_seed: int, pairs: list[list[int]],
                   layout: str, dst_is_local: bool) -> dict[str, Any]:
    """Flat bytes each destination region should hold: base pattern (zeros when None), with the moved blocks
    of the source pattern at their destination offsets."""
    from pdserve.transfer.regions import byte_tensor
    flats = {n: byte_tensor(t) for n, t in tensors.items()}
    out, src = {}, {}
    for n, flat in flats.items():
        size, dev = flat.numel(), flat.device
        out[n] = region_pattern(n, size, base_seed, dev) if base_seed is not None else flat.new_zeros(size)
        src[n] = region_pattern(n, size, moved_seed, dev)
    for local_b, peer_b in pairs:
        dst_b, src_b = (local_b, peer_b) if dst_is_local else (peer_b, local_b)
        for (region, d_off, n), (_, s_off, _) in zip(block_spans(layout, dst_b), block_spans(layout, src_b)):
            out[region][d_off : d_off + n] = src[region][s_off : s_off + n]
    return out


def mismatched_bytes(tensors: dict[str, Any], expected: dict[str, Any], regions: list[str]) -> int:
    from pdserve.transfer.regions import byte_tensor
    return sum(int((byte_tensor(tensors[r]) != expected[r]).sum().item()) for r in regions)


def sync(device: Any) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- processes ----
def engines_for(backends: list[str], device: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """One engine per optional backend plus "base" (tcp and local), each registering every region."""
    from pdserve.transfer import TransferConfig, TransferEngine
    engines = {}
    for name in ["base", *backends]:
        eng = TransferEngine(TransferConfig(secret=SECRET, backend="auto" if name == "base" else name))
        for region, t in tensors.items():
            eng.register(region, t)
        engines[name] = eng
    sync(device)
    return engines


def owner_main(conn: Any, device_index: int, backends: list[str], kind: str = "cuda") -> None:
    import torch
    device = torch.device(kind, device_index) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    tensors = make_layouts(device)
    tensors["bw"] = torch.zeros(BW_BYTES, dtype=torch.uint8, device=device)
    fill(tensors, 1)
    engines = engines_for(backends, device, tensors)
    conn.send_bytes(msgpack.packb({n: e.segment().to_wire() for n, e in engines.items()}, use_bin_type=True))
    while True:
        msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "reset":
            fill(tensors, 1)
            sync(device)
            conn.send_bytes(msgpack.packb({"ok": True}))
        elif msg["cmd"] == "check":  # after a WRITE: blocks replaced, everything else as filled
            sync(device)
            layout_tensors = {r: tensors[r] for r in LAYOUTS[msg["layout"]]}
            exp = expected_after(layout_tensors, 1, 2, msg["pairs"], msg["layout"], dst_is_local=False)
            conn.send_bytes(msgpack.packb({"bad": mismatched_bytes(layout_tensors, exp, list(layout_tensors))}))
    for eng in engines.values():
        eng.close()
    os._exit(0)  # NIXL can crash in interpreter teardown


def scattered_pairs(n: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[i, p] for i, p in enumerate(rng.sample(range(NB), n))]


def layout_entries(layout: str, pairs: list[list[int]]) -> list[tuple[str, int, str, int, int]]:
    out = []
    for local_b, peer_b in pairs:
        for (region, l_off, n), (_, p_off, _) in zip(block_spans(layout, local_b), block_spans(layout, peer_b)):
            out.append((region, l_off, region, p_off, n))
    return out


def check_backend(backend: str, eng: Any, peer: dict, owner: Any, local: dict[str, Any], blocks: int) -> dict[str, Any]:
    from pdserve.transfer import Op
    results: dict[str, Any] = {}
    device = local["bw"].device
    for layout, regions in LAYOUTS.items():
        lt = {r: local[r] for r in regions}
        pairs = scattered_pairs(blocks, seed=sum(map(ord, layout)))
        for r in regions:
            local[r].zero_()
        sync(device)
        eng.submit(peer, layout_entries(layout, pairs), Op.READ, backend=backend).result(timeout=60)
        sync(device)
        bad_read = mismatched_bytes(lt, expected_after(lt, None, 1, pairs, layout, dst_is_local=True), regions)
        fill(lt, 2)
        sync(device)
        eng.submit(peer, layout_entries(layout, pairs), Op.WRITE, backend=backend).result(timeout=60)
        owner.send_bytes(msgpack.packb({"cmd": "check", "layout": layout, "pairs": pairs}))
        bad_write = msgpack.unpackb(owner.recv_bytes())["bad"]
        owner.send_bytes(msgpack.packb({"cmd": "reset"}))
        owner.recv_bytes()
        results[f"{layout}_read_ok"] = bad_read == 0
        results[f"{layout}_write_ok"] = bad_write == 0
    return results


def bandwidth(backend: str, eng: Any, peer: dict, reps: int) -> dict[str, float]:
    import random

    from anchors import median_gbps

    from pdserve.transfer import Op
    out = {}
    for size, label in ((16 * MiB, "16MiB"), (256 * MiB, "256MiB")):
        entries = [("bw", 0, "bw", 0, size)]
        out[label] = median_gbps(size, lambda e=entries: eng.submit(peer, e, Op.READ, backend=backend).result(), reps)
    order = random.Random(0).sample(range(BW_BYTES // SCATTER), BW_BYTES // SCATTER)
    entries = [("bw", i * SCATTER, "bw", j * SCATTER, SCATTER) for i, j in enumerate(order)]
    out["4096x64KiB"] = median_gbps(
        BW_BYTES, lambda: eng.submit(peer, entries, Op.READ, backend=backend).result(), reps)
    return out


def torch_anchors(device: Any, reps: int) -> dict[str, float]:
    import torch
    from anchors import median_gbps
    src = torch.ones(BW_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    pinned = torch.empty(BW_BYTES, dtype=torch.uint8, pin_memory=True)

    def d2d() -> None:
        dst.copy_(src)
        torch.cuda.synchronize(device)

    def d2h() -> None:
        pinned.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    return {"torch_d2d_256MiB": median_gbps(BW_BYTES, d2d, reps),
            "torch_d2h_pinned_256MiB": median_gbps(BW_BYTES, d2h, reps)}


def plane_rows(layout: str, tensors: dict[str, Any]) -> list[Any]:
    """Each block's bytes as rows, per contiguous piece of a block in memory order: [NB, bytes] uint8 views."""
    from pdserve.transfer.regions import byte_tensor
    if layout == "nhd":
        flat = byte_tensor(tensors["nhd"]).view(2, NB, BLK)
        return [flat[0], flat[1]]
    if layout == "hnd":
        return [byte_tensor(tensors["hnd"]).view(NB, 2 * BLK)]
    return [byte_tensor(tensors["k"]).view(NB, BLK), byte_tensor(tensors["v"]).view(NB, BLK)]


def block_wsums(rows: list[Any]) -> Any:
    """The connector's device checksum of every block: the pieces' position-weighted sums, added up."""
    from pdserve.transfer.checksum import wsum_rows
    total, word = None, 0
    for r in rows:
        part = wsum_rows(r, word)
        total, word = (part if total is None else total + part), word + r.shape[1] // 4
    return total


def checksum_check(tensors: dict[str, Any], device: Any, reps: int) -> dict[str, Any]:
    """wsum32 on this device: equal to the host computation of the same bytes, a flip changes one block's sum only,
    and GB/s over the nhd cache."""
    import torch
    from anchors import median_gbps
    fill(tensors, seed=5)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        rows = plane_rows(layout, tensors)
        sums = block_wsums(rows)
        host = block_wsums([r.cpu() for r in rows])
        out[f"checksum_{layout}_host_equal_ok"] = bool(torch.equal(sums.cpu(), host))
        rows[-1][7, 11].bitwise_xor_(0x40)
        changed = (block_wsums(rows) != sums).nonzero().flatten().tolist()
        rows[-1][7, 11].bitwise_xor_(0x40)
        out[f"checksum_{layout}_flip_ok"] = changed == [7]
    rows = plane_rows("nhd", tensors)

    def reduce() -> None:
        block_wsums(rows)
        sync(device)

    out["checksum_gbps_nhd_16MiB"] = round(median_gbps(2 * NB * BLK, reduce, reps), 2)
    return out


def fence_check(device: Any) -> dict[str, Any]:
    """pdserve.vllm.fence on this device (issue 37, layer-wise sends from device memory): an update given after
    ~0.2 s of queued kernels runs once they ran (the event has completed and the time has passed), the giving
    thread only records and queues, and an update given with no event runs at once."""
    import threading

    import torch

    from pdserve.vllm.fence import DeviceFence, record_event
    fence, seen, done = DeviceFence(), {}, threading.Event()
    buf = torch.zeros(16 * MiB // 4, dtype=torch.int32, device=device)
    sync(device)
    t0 = time.perf_counter()
    torch.cuda._sleep(int(4e8))  # queued work: a layer's kernels not yet run
    buf.fill_(7)
    event = record_event(True)
    fence.after(None, lambda: seen.update(now=event.query()))  # nothing queued before it: at once
    fence.after(event, lambda: (seen.update(query=event.query(), at=time.perf_counter() - t0), done.set()))
    queued_s = time.perf_counter() - t0
    ran = done.wait(60)
    sync(device)
    kernel_s = time.perf_counter() - t0
    return {"fence_waited_ok": bool(ran and seen.get("query") and seen.get("now") is False),
            "fence_after_kernels_ok": bool(ran and seen["at"] >= 0.5 * kernel_s),
            "fence_sum_ok": int(buf.sum().item()) == 7 * buf.numel(),
            "fence_queue_ms": round(queued_s * 1e3, 3), "fence_kernels_ms": round(kernel_s * 1e3, 1)}


def run(args: argparse.Namespace, gpu: str) -> dict[str, Any]:
    import torch
    optional = optional_backends()
    usable = [n for n, why in optional.items() if why is None]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    kind = "cpu" if args.cpu_selftest else "cuda"
    if args.cpu_selftest:  # the harness on CPU tensors, tcp and local (process_vm) only
        optional, usable = {}, []
    proc = ctx.Process(target=owner_main, args=(child, args.owner_device, usable, kind), daemon=True)
    proc.start()
    result: dict[str, Any] = {"cuda": kind == "cuda", "gpu": gpu,
                              "skipped": {n: why for n, why in optional.items() if why}}
    rows: list[tuple[str, str, str]] = []
    try:
        if not parent.poll(120):
            raise RuntimeError("owner process did not start within 120 s")
        segments = msgpack.unpackb(parent.recv_bytes(), raw=False)
        device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
        local = make_layouts(device)
        local["bw"] = torch.zeros(BW_BYTES, dtype=torch.uint8, device=device)
        engines = engines_for(usable, device, local)
        if kind == "cuda":
            anchors = torch_anchors(device, args.reps)
            result.update({k: round(v, 2) for k, v in anchors.items()})
            rows += [("torch", k, f"{v:.2f}") for k, v in anchors.items()]
        plan = [("tcp", "base", "tcp"), ("local", "base", "local")] + [(n, n, n) for n in usable]
        for label, eng_name, use in plan:
            eng, peer = engines[eng_name], segments[eng_name]
            if use == "local" and kind == "cuda" and not peer["backends"].get("local", {}).get("ipc"):
                result["skipped"]["local"] = "owner exported no CUDA IPC handles (not the same host, or IPC refused)"
                continue
            try:
                checks = check_backend(use, eng, peer, parent, local, args.blocks)
                gbps = bandwidth(use, eng, peer, args.reps)
            except Exception as exc:
                traceback.print_exc()
                result[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
                rows.append((label, "error", str(exc)[:60]))
                continue
            result.update({f"{label}_{k}": v for k, v in checks.items()})
            result.update({f"{label}_gbps_{k}": round(v, 2) for k, v in gbps.items()})
            rows.append((label, "byte-exact", "ok" if all(checks.values()) else
                         "FAILED " + ",".join(k for k, v in checks.items() if not v)))
            rows += [(label, k, f"{v:.2f}") for k, v in gbps.items()]
        for eng in engines.values():
            eng.close()
        sums = checksum_check({k: local[k] for k in ("nhd", "hnd", "k", "v")}, device, args.reps)
        result.update(sums)
        rows.append(("checksum", "wsum32 byte-exact", "ok" if all(v for k, v in sums.items() if k.endswith("_ok"))
                     else "FAILED " + ",".join(k for k, v in sums.items() if k.endswith("_ok") and not v)))
        rows.append(("checksum", "wsum32 16MiB", f"{sums['checksum_gbps_nhd_16MiB']:.2f}"))
        if kind == "cuda":
            fenced = fence_check(device)
            result.update(fenced)
            rows.append(("fence", "after the kernels", "ok" if all(v for k, v in fenced.items() if k.endswith("_ok"))
                         else "FAILED " + ",".join(k for k, v in fenced.items() if k.endswith("_ok") and not v)))
            rows.append(("fence", "queue ms (model thread)", f"{fenced['fence_queue_ms']:.3f}"))
    finally:
        try:
            parent.send_bytes(msgpack.packb({"cmd": "quit"}))
        except OSError:
            pass
        proc.join(30)
    print(f"{'path':<12}{'what':>26}{'GB/s / result':>16}")
    for path, what, value in rows:
        print(f"{path:<12}{what:>26}{value:>16}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per point (after one warm-up)")
    ap.add_argument("--blocks", type=int, default=64, help="scattered blocks per correctness check")
    ap.add_argument("--owner-device", type=int, default=0, help="CUDA device of the owner process")
    ap.add_argument("--cpu-selftest", action="store_true",
                    help="run the same checks on CPU tensors (tcp, local): tests this harness, measures nothing GPU")
    args = ap.parse_args()
    ok, why = (True, "cpu self-test") if args.cpu_selftest else cuda_ready()
    if not ok:
        print(f"no CUDA device: nothing run ({why})")
        print(json.dumps({"cuda": False, "reason": why, "ran": []}))
        return 0
    t0 = time.monotonic()
    result = run(args, why)
    result["seconds"] = round(time.monotonic() - t0, 1)
    failed = [k for k, v in result.items() if k.endswith("_ok") and v is False] + \
             [k for k in result if k.endswith("_error")]
    result["failed"] = failed
    print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # NIXL can crash in interpreter teardown
