"""Anchor measurements for transfer_bench.py: Mooncake TE's own TCP transport and NIXL (UCX), each
driven through its own Python API between two processes, when the package is installed.

Each anchor runs in a fresh pair of spawned processes that end with os._exit (NIXL segfaults at
interpreter exit). Returns rows (name, size label, GB/s median).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

MiB = 1 << 20


def median_gbps(nbytes: int, fn: Callable[[], None], reps: int) -> float:
    """GB/s of the median of ``reps`` timed calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


# ---- Mooncake TE, TCP transport, P2P handshake (no metadata server) ----
def _mooncake_engine():
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TE failed to initialise")
    return te, f"127.0.0.1:{te.get_rpc_port()}"


def _mooncake_target(conn, size: int) -> None:
    te, session = _mooncake_engine()
    buf = np.zeros(size, dtype=np.uint8)
    te.register_memory(buf.ctypes.data, size)
    conn.send((session, buf.ctypes.data))
    conn.recv()
    os._exit(0)


def _mooncake_initiator(conn, target_info, sizes: list[int], reps: int) -> None:
    te, _ = _mooncake_engine()
    session, raddr = target_info
    src = np.ones(max(sizes), dtype=np.uint8)
    te.register_memory(src.ctypes.data, src.nbytes)
    out = {}
    for size in sizes:
        def once(size: int = size) -> None:
            if te.transfer_sync_write(session, src.ctypes.data, raddr, size) != 0:
                raise RuntimeError("Mooncake write failed")
        out[size] = median_gbps(size, once, reps)
    conn.send(out)
    os._exit(0)


# ---- NIXL, UCX, no progress thread (its busy-polling thread would take a core) ----
def _nixl_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _nixl_target(conn, size: int) -> None:
    agent = _nixl_agent("bench-target")
    buf = np.zeros(size, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    while not conn.poll(0):  # without NIXL's progress thread the target must drive UCX; a 0.1 ms
        agent.get_new_notifs()  # tick keeps the anchor near its best (slower ticks cap its GB/s)
        time.sleep(1e-4)
    os._exit(0)


def nixl_write(agent, local_rows: list[tuple[int, int, int]], peer_rows: list[tuple[int, int, int]], remote) -> None:
    """One NIXL WRITE batch of host-memory rows (address, bytes, device), polled to its end."""
    local = agent.get_xfer_descs(local_rows, "DRAM")
    peer = agent.get_xfer_descs(peer_rows, "DRAM")
    handle = agent.initialize_xfer("WRITE", local, peer, remote, b"")
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer ended {state}")


def _nixl_initiator(conn, target_info, sizes: list[int], reps: int) -> None:
    agent = _nixl_agent("bench-initiator")
    metadata, raddr = target_info
    remote = agent.add_remote_agent(metadata)
    src = np.ones(max(sizes), dtype=np.uint8)
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    out = {}
    for size in sizes:
        def once(size: int = size) -> None:
            nixl_write(agent, [(src.ctypes.data, size, 0)], [(raddr, size, 0)], remote)
        out[size] = median_gbps(size, once, reps)
    conn.send(out)
    os._exit(0)


ANCHORS = {
    "mooncake_tcp": ("mooncake.engine", _mooncake_target, _mooncake_initiator),
    "nixl": ("nixl._api", _nixl_target, _nixl_initiator),
}


def _importable(module: str) -> bool:
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_try_import, args=(module,))
    proc.start()
    proc.join(60)
    return proc.exitcode == 0


def _try_import(module: str) -> None:
    try:
        __import__(module)
    except Exception:
        os._exit(1)
    os._exit(0)


def _run_pair(target, initiator, sizes: list[int], reps: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    tp = ctx.Process(target=target, args=(t_child, max(sizes)))
    tp.start()
    try:
        info = t_conn.recv()
        ip = ctx.Process(target=initiator, args=(i_child, info, sizes, reps))
        ip.start()
        result = i_conn.recv() if i_conn.poll(300) else {}
        ip.join(30)
        return result
    finally:
        t_conn.send("stop")
        tp.join(30)
        if tp.is_alive():
            tp.kill()


def run_anchors(sizes: list[int], reps: int) -> list[tuple[str, str, float]]:
    rows = []
    for name, (module, target, initiator) in ANCHORS.items():
        if not _importable(module):
            print(f"[anchors] {name}: {module} not importable, skipped")
            continue
        for size, gbps in _run_pair(target, initiator, sizes, reps).items():
            rows.append((name, f"{size // MiB}MiB", gbps))
    return rows
