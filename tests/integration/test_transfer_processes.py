"""Transfer engine between real processes on 127.0.0.1: data, failures, refusals."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time

import numpy as np
import pytest

from pdserve.transfer import BatchStatus, Op, SegmentDescriptor, TransferConfig, TransferEngine, TransferError, wire
from pdserve.transfer.connection import Connection

from .conftest import SECRET

pytestmark = pytest.mark.integration
MiB = 1 << 20
BACKENDS = ["tcp", "local"]


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def sha(arr: np.ndarray) -> str:
    return hashlib.sha256(arr.tobytes()).hexdigest()


@pytest.fixture
def engine():
    eng = TransferEngine(TransferConfig(secret=SECRET, streams=3, slice_bytes=1 * MiB))
    src = pattern(8 * MiB, 7)
    eng.register("src", src)
    eng.src = src
    yield eng
    eng.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_lands_byte_exact_and_touches_nothing_else(engine, spawn_peer, backend):
    peer = spawn_peer(16 * MiB, seed=1)
    entries = [("src", 0, "mem", MiB, 5 * MiB), ("src", 5 * MiB + 3, "mem", 15 * MiB, 12345)]
    engine.submit(peer.descriptor, entries, Op.WRITE, backend=backend).result(timeout=30)
    expected = pattern(16 * MiB, 1)
    expected[MiB : 6 * MiB] = engine.src[: 5 * MiB]
    expected[15 * MiB : 15 * MiB + 12345] = engine.src[5 * MiB + 3 : 5 * MiB + 3 + 12345]
    assert peer.sha(0, 16 * MiB) == sha(expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_brings_peer_bytes_exactly(engine, spawn_peer, backend):
    peer = spawn_peer(4 * MiB, seed=2)
    dst = np.zeros(6 * MiB, dtype=np.uint8)
    engine.register("dst", dst)
    entries = [("dst", 100, "mem", 0, 4 * MiB), ("dst", 5 * MiB, "mem", 17, 999)]
    engine.submit(peer.descriptor, entries, Op.READ, backend=backend).result(timeout=30)
    expected = pattern(4 * MiB, 2)
    assert sha(dst[100 : 100 + 4 * MiB]) == sha(expected)
    assert sha(dst[5 * MiB : 5 * MiB + 999]) == sha(expected[17:1016])
    assert not dst[:100].any() and not dst[100 + 4 * MiB : 5 * MiB].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_thousands_of_scattered_blocks(engine, spawn_peer, backend):
    block, n = 2048, 4096
    peer = spawn_peer(n * block, seed=3)
    order = np.random.default_rng(0).permutation(n)
    entries = [("src", i * block, "mem", int(j) * block, block) for i, j in enumerate(order)]
    engine.submit(peer.descriptor, entries, Op.WRITE, backend=backend).result(timeout=60)
    expected = np.empty(n * block, dtype=np.uint8)
    for i, j in enumerate(order):
        expected[j * block : (j + 1) * block] = engine.src[i * block : (i + 1) * block]
    assert peer.sha(0, n * block) == sha(expected)
    back = np.zeros(n * block, dtype=np.uint8)
    engine.register("back", back)
    engine.submit(peer.descriptor, [("back", e[1], "mem", e[3], e[4]) for e in entries],
                  Op.READ, backend=backend).result(timeout=60)
    assert sha(back) == sha(engine.src[: n * block])


def test_concurrent_batches_to_several_peers(engine, spawn_peer):
    peers = [spawn_peer(4 * MiB, seed=10 + i) for i in range(3)]
    handles = []
    for i, peer in enumerate(peers):
        for j, backend in enumerate(BACKENDS):
            off = (2 * i + j) * 512 * 1024
            entries = [("src", off, "mem", j * 2 * MiB, 512 * 1024)]
            handles.append((peer, j, off, engine.submit(peer.descriptor, entries, backend=backend,
                                                        notify=f"n{i}{j}")))
    for _, _, _, h in handles:
        h.result(timeout=30)
    for i, peer in enumerate(peers):
        expected = pattern(4 * MiB, 10 + i)
        for p, j, off, _ in handles:
            if p is peer:
                expected[j * 2 * MiB : j * 2 * MiB + 512 * 1024] = engine.src[off : off + 512 * 1024]
        assert peer.sha(0, 4 * MiB) == sha(expected)
        assert sorted(peer.notes()) == [f"n{i}0", f"n{i}1"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_notification_is_delivered_with_the_batch(engine, spawn_peer, backend):
    peer = spawn_peer(MiB)
    engine.submit(peer.descriptor, [("src", 0, "mem", 0, 1000)], backend=backend, notify=b"req-42").result(10)
    assert peer.notes() == ["req-42"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_stalled_peer_fails_the_batch_by_its_deadline(engine, spawn_peer, backend):
    peer = spawn_peer(64 * MiB)
    big = np.zeros(64 * MiB, dtype=np.uint8)
    engine.register("big", big)
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        h = engine.submit(peer.descriptor, [("big", 0, "mem", 0, 64 * MiB)], backend=backend, deadline_s=1.0)
        assert h.wait() is BatchStatus.FAILED
        assert time.monotonic() - t0 < 3.0
        assert h.error.code == "deadline"
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    assert peer.alive()


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_killed_mid_transfer_fails_cleanly_and_others_go_on(engine, spawn_peer, backend):
    victim, other = spawn_peer(64 * MiB), spawn_peer(MiB, seed=5)
    big = np.ones(64 * MiB, dtype=np.uint8)
    engine.register("big", big)
    os.kill(victim.proc.pid, signal.SIGSTOP)  # holds the transfer mid-flight
    h = engine.submit(victim.descriptor, [("big", 0, "mem", 0, 64 * MiB)], backend=backend, deadline_s=20)
    time.sleep(0.3)
    assert h.poll() is BatchStatus.PENDING
    t0 = time.monotonic()
    victim.proc.kill()
    assert h.wait() is BatchStatus.FAILED
    assert time.monotonic() - t0 < 5.0, "a dead peer must fail the batch well before its deadline"
    assert h.error.code in ("peer", "unavailable")
    engine.submit(other.descriptor, [("src", 0, "mem", 0, 4096)], backend=backend).result(10)
    assert other.sha(0, 4096) == sha(engine.src[:4096])


def test_abort_ends_a_stuck_batch_at_once(engine, spawn_peer):
    peer = spawn_peer(64 * MiB)
    big = np.ones(64 * MiB, dtype=np.uint8)
    engine.register("big", big)
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        h = engine.submit(peer.descriptor, [("big", 0, "mem", 0, 64 * MiB)], backend="tcp", deadline_s=30)
        time.sleep(0.2)
        t0 = time.monotonic()
        h.abort()
        assert h.wait() is BatchStatus.ABORTED and time.monotonic() - t0 < 0.5
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    engine.submit(peer.descriptor, [("src", 0, "mem", 0, 4096)], backend="tcp").result(10)
    assert peer.sha(0, 4096) == sha(engine.src[:4096])


def test_wrong_secret_is_refused_and_the_peer_keeps_serving(engine, spawn_peer):
    peer = spawn_peer(MiB, seed=4)
    intruder = TransferEngine(TransferConfig(secret="not-the-right-secret"))
    intruder.register("x", np.ones(4096, dtype=np.uint8))
    try:
        h = intruder.submit(peer.descriptor, [("x", 0, "mem", 0, 4096)], backend="tcp")
        assert h.wait(10) is BatchStatus.FAILED and h.error.code == "auth"
        with pytest.raises(TransferError) as info:
            intruder.fetch_segment("127.0.0.1", peer.descriptor["port"])
        assert info.value.code == "auth"
    finally:
        intruder.close()
    assert peer.sha(0, MiB) == sha(pattern(MiB, 4))
    engine.write(peer.descriptor, [("src", 0, "mem", 0, 4096)])
    assert peer.sha(0, 4096) == sha(engine.src[:4096])


@pytest.mark.parametrize("backend", BACKENDS)
def test_owner_refuses_ranges_outside_its_regions(engine, spawn_peer, backend):
    peer = spawn_peer(MiB, seed=6)
    forged = dict(peer.descriptor, regions={"mem": [0, 64 * MiB], "ghost": [0, MiB]})
    for entries in ([("src", 0, "mem", MiB - 100, 4096)], [("src", 0, "ghost", 0, 16)]):
        h = engine.submit(forged, entries, backend=backend)
        assert h.wait(10) is BatchStatus.FAILED
        assert h.error.code in ("bounds", "unknown_region")
    with pytest.raises(TransferError) as info:  # our own pre-check refuses before sending
        engine.submit(peer.descriptor, [("src", 0, "mem", MiB - 1, 2)])
    assert info.value.code == "bounds"
    assert peer.alive() and peer.sha(0, MiB) == sha(pattern(MiB, 6))


def test_raw_malformed_requests_get_errors_and_the_engine_survives(spawn_peer):
    peer = spawn_peer(MiB, seed=8)
    desc = SegmentDescriptor.from_wire(peer.descriptor)
    conn = Connection(desc.address, TransferConfig(secret=SECRET))
    payload = memoryview(bytes(100))
    try:
        bad = [{"t": "w", "e": [["mem", MiB - 10, 100]]}, {"t": "w", "e": [["nope", 0, 100]]}]
        for msg in bad:  # rejected, payload drained, the connection stays in step
            wire.send_msg(conn.sock, msg, [payload])
            reply = wire.recv_msg(conn.sock)
            assert reply["t"] == "err" and reply["code"] in ("bounds", "unknown_region")
        with pytest.raises(TransferError, match="bounds"):
            conn.call({"t": "r", "e": [["mem", 0, MiB + 1]]}, 5)
        with pytest.raises(TransferError, match="same-host"):
            conn.call({"t": "lw", "e": [["mem", 0, 16, 4096]]}, 5)  # local copies need the Unix socket
        wire.send_msg(conn.sock, {"t": "w", "e": [["mem", 0, 4]]}, [memoryview(b"good")])
        assert wire.recv_msg(conn.sock)["t"] == "ok"
        with pytest.raises(TransferError, match="malformed"):
            conn.call({"t": "w", "e": [["mem", "zero", 4]]}, 5)
    finally:
        conn.close()
    raw = socket.create_connection(desc.address, timeout=5)
    raw.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
    raw.close()
    expected = pattern(MiB, 8)
    expected[:4] = np.frombuffer(b"good", dtype=np.uint8)
    assert peer.alive() and peer.sha(0, MiB) == sha(expected)


def test_malformed_same_host_requests_are_refused(spawn_peer):
    peer = spawn_peer(MiB, seed=9)
    uds = peer.descriptor["backends"]["local"]["uds"]
    mine = np.zeros(64, dtype=np.uint8)
    cases = [
        ({"t": "lw", "names": ["mem"], "cols": bytes(31)}, "protocol"),
        ({"t": "lw", "names": ["mem"], "cols": np.array([[1, 0, 8, 0]], np.uint64).tobytes()}, "protocol"),
        ({"t": "lw", "names": ["nope"], "cols": np.array([[0, 0, 8, 0]], np.uint64).tobytes()}, "unknown_region"),
        ({"t": "lw", "names": ["mem"],
          "cols": np.array([[0, MiB - 4, 8, mine.ctypes.data]], np.uint64).tobytes()}, "bounds"),
        ({"t": "lr", "names": ["mem"],
          "cols": np.array([[0, 2**63, 2**63, mine.ctypes.data]], np.uint64).tobytes()}, "bounds"),
    ]
    for msg, code in cases:
        conn = Connection(uds, TransferConfig(secret=SECRET))
        try:
            with pytest.raises(TransferError) as info:
                conn.call(msg, 5)
            assert info.value.code == code, msg
        finally:
            conn.close()
    assert peer.alive() and peer.sha(0, MiB) == sha(pattern(MiB, 9))


def test_fetch_segment_returns_the_live_descriptor(engine, spawn_peer):
    peer = spawn_peer(MiB)
    desc = engine.fetch_segment("127.0.0.1", peer.descriptor["port"])
    assert desc == SegmentDescriptor.from_wire(peer.descriptor)
    assert desc.regions["mem"][1] == MiB


def test_auto_picks_the_same_host_path_for_a_local_peer(engine, spawn_peer):
    peer = spawn_peer(MiB)
    assert engine.choose_backend(SegmentDescriptor.from_wire(peer.descriptor)).name == "local"
    remote_looking = dict(peer.descriptor, host_id="another-machine")
    assert engine.choose_backend(SegmentDescriptor.from_wire(remote_looking)).name == "tcp"
