"""The staging pipeline on CPU: the host copier stands in for the CUDA one (same chunking, double
buffering, deadlines, aborts and error paths)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from pdserve.transfer import TransferError
from pdserve.transfer.batch import BatchHandle, Op
from pdserve.transfer.staging import (
    CopierPool,
    HostCopier,
    HostMemory,
    plan_chunks,
    recv_parts,
    recv_staged,
    runs,
    send_parts,
    send_staged,
)

KiB = 1 << 10


def memory(data: np.ndarray) -> HostMemory:
    return HostMemory(memoryview(data).cast("B"), int(data.ctypes.data))


class Overlap:
    """Counts how many timed operations (copies, socket sends/receives) run at once: the proof of overlap
    without reading the wall clock, which a loaded machine stretches."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self._lock = threading.Lock()

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            yield
        finally:
            with self._lock:
                self.now -= 1


class SlowCopier(HostCopier):
    """A host copier whose every copy job takes ``delay`` seconds, like a device copy would."""

    def __init__(self, chunk_bytes: int, delay: float = 0.0, fail_after: int | None = None,
                 overlap: Overlap | None = None) -> None:
        super().__init__(chunk_bytes)
        self.delay, self.fail_after, self.copies = delay, fail_after, 0
        self.overlap = overlap or Overlap()

    def _copy(self, dst: memoryview, src: memoryview) -> None:
        self.copies += 1
        if self.fail_after is not None and self.copies > self.fail_after:
            raise RuntimeError("simulated device fault")
        with self.overlap.running():
            time.sleep(self.delay)
        dst[:] = src


def forever() -> float:
    return 30.0


def test_chunks_cover_every_byte_in_order_and_never_exceed_the_buffer():
    a, b = memory(np.zeros(100, np.uint8)), memory(np.zeros(300, np.uint8))
    pieces = [(a, 10, 90), (b, 0, 250), (a, 0, 5)]
    chunks = plan_chunks(pieces, 64)
    assert all(sum(n for _, _, n in c) <= 64 for c in chunks)
    assert [sum(n for _, _, n in c) for c in chunks][:-1] == [64] * (len(chunks) - 1)
    flat = [(m, o + i) for c in chunks for m, o, n in c for i in range(n)]
    assert flat == [(m, o + i) for m, o, n in pieces for i in range(n)]


def test_send_staged_sends_the_device_bytes_exactly():
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    mem = memory(data)
    out = bytearray()
    copier = HostCopier(1000)
    pieces = [(mem, 7, 4321), (mem, 5000, 3000), (mem, 0, 1)]
    sent_sizes = []
    send_staged(pieces, copier, lambda v: (out.extend(v), sent_sizes.append(v.nbytes)), forever)
    assert bytes(out) == data[7:4328].tobytes() + data[5000:8000].tobytes() + data[:1].tobytes()
    assert max(sent_sizes) == 1000 and sum(sent_sizes) == 7322


def test_recv_staged_lands_bytes_and_leaves_the_rest_untouched():
    dst = np.zeros(10_000, np.uint8)
    mem = memory(dst)
    src = np.random.default_rng(1).integers(1, 256, 5000, dtype=np.uint8).tobytes()
    stream = memoryview(src)
    pos = [0]

    def recv(v: memoryview) -> None:
        v[:] = stream[pos[0] : pos[0] + v.nbytes]
        pos[0] += v.nbytes

    recv_staged([(mem, 100, 3000), (mem, 8000, 2000)], HostCopier(512), recv, forever)
    assert dst[100:3100].tobytes() == src[:3000] and dst[8000:10000].tobytes() == src[3000:]
    assert not dst[:100].any() and not dst[3100:8000].any()


def test_copy_of_the_next_chunk_overlaps_sending_this_one():
    chunks, delay = 8, 0.04
    data = np.arange(chunks * 1024, dtype=np.uint32).view(np.uint8)[: chunks * 4096].copy()
    mem = memory(data)
    out = bytearray()
    overlap = Overlap()

    def slow_send(v: memoryview) -> None:
        with overlap.running():
            time.sleep(delay)
        out.extend(v)

    send_staged([(mem, 0, data.nbytes)], SlowCopier(4096, delay, overlap=overlap), slow_send, forever)
    assert bytes(out) == data.tobytes()
    assert overlap.most == 2, "the next chunk's copy never ran while this chunk was being sent"


def test_receiving_the_next_chunk_overlaps_copying_this_one_to_the_device():
    chunks, delay = 8, 0.04
    dst = np.zeros(chunks * 4096, np.uint8)
    src = np.random.default_rng(2).integers(0, 256, dst.nbytes, dtype=np.uint8).tobytes()
    pos = [0]
    overlap = Overlap()

    def slow_recv(v: memoryview) -> None:
        with overlap.running():
            time.sleep(delay)
        v[:] = src[pos[0] : pos[0] + v.nbytes]
        pos[0] += v.nbytes

    recv_staged([(memory(dst), 0, dst.nbytes)], SlowCopier(4096, delay, overlap=overlap), slow_recv, forever)
    assert dst.tobytes() == src
    assert overlap.most == 2, "the next chunk was never received while this one was copied to the device"


def test_a_copy_stuck_past_the_deadline_fails_the_transfer_in_time():
    handle = BatchHandle("b", Op.READ, 0, time.monotonic() + 0.2)
    mem = memory(np.zeros(8192, np.uint8))
    t0 = time.monotonic()
    with pytest.raises(TransferError) as err:
        send_staged([(mem, 0, 8192)], SlowCopier(4096, delay=3.0), lambda v: None, handle.remaining)
    assert err.value.code == "deadline" and time.monotonic() - t0 < 1.5


def test_abort_stops_the_pipeline_between_chunks():
    handle = BatchHandle("b", Op.WRITE, 0, time.monotonic() + 30)
    mem = memory(np.zeros(64 * KiB, np.uint8))
    sent = []

    def send(v: memoryview) -> None:
        sent.append(v.nbytes)
        handle.abort()

    with pytest.raises(TransferError) as err:
        send_staged([(mem, 0, 64 * KiB)], HostCopier(4 * KiB), send, handle.remaining)
    assert err.value.code == "aborted" and len(sent) == 1


def test_a_copier_error_surfaces_as_a_device_error():
    mem = memory(np.zeros(16 * KiB, np.uint8))
    with pytest.raises(TransferError) as err:
        send_staged([(mem, 0, 16 * KiB)], SlowCopier(4 * KiB, fail_after=2), lambda v: None, forever)
    assert err.value.code == "device" and "simulated device fault" in err.value.message
    with pytest.raises(TransferError) as err:
        recv_staged([(mem, 0, 16 * KiB)], SlowCopier(4 * KiB, fail_after=0), lambda v: None, forever)
    assert err.value.code == "device"


def test_runs_keep_order_and_split_host_views_from_staged_pieces():
    a, b = memory(np.zeros(10, np.uint8)), memory(np.zeros(10, np.uint8))
    h = memoryview(bytearray(4))
    groups = runs([h, h, (a, 0, 1), (b, 0, 2), h])
    assert [(host, len(parts)) for host, parts in groups] == [(True, 2), (False, 2), (True, 1)]


def test_parts_mix_host_views_and_staged_pieces_in_one_payload():
    data = np.arange(256, dtype=np.uint8)
    mem = memory(data)
    head = memoryview(b"HEAD")
    pool = CopierPool(16)
    out = bytearray()
    send_parts([head, (mem, 10, 40), memoryview(b"TAIL")], pool, lambda vs: [out.extend(v) for v in vs], forever)
    assert bytes(out) == b"HEAD" + data[10:50].tobytes() + b"TAIL"
    dst = np.zeros(64, np.uint8)
    host = bytearray(3)
    payload = memoryview(b"xyz" + bytes(range(100, 130)))
    pos = [0]

    def recv(vs: list[memoryview]) -> None:
        for v in vs:
            v[:] = payload[pos[0] : pos[0] + v.nbytes]
            pos[0] += v.nbytes

    recv_parts([memoryview(host), (memory(dst), 2, 30)], pool, recv, forever)
    assert host == b"xyz" and dst[2:32].tobytes() == bytes(range(100, 130)) and not dst[32:].any()
    pool.close()


def test_pool_reuses_a_healthy_copier_and_drops_one_that_failed():
    mem = memory(np.zeros(8, np.uint8))
    pool = CopierPool(4096)
    with pool.borrow(mem) as first:
        pass
    with pool.borrow(mem) as again:
        assert again is first
    with pytest.raises(RuntimeError):
        with pool.borrow(mem) as broken:
            raise RuntimeError("boom")
    with pool.borrow(mem) as fresh:
        assert fresh is not broken
    pool.close()


def test_two_lanes_borrow_two_copiers():
    mem = memory(np.zeros(8, np.uint8))
    pool = CopierPool(4096)
    seen, barrier = [], threading.Barrier(2)

    def lane() -> None:
        with pool.borrow(mem) as copier:
            seen.append(copier)
            barrier.wait(5)

    threads = [threading.Thread(target=lane) for _ in range(2)]
    [t.start() for t in threads]
    [t.join(5) for t in threads]
    assert len(seen) == 2 and seen[0] is not seen[1]
    pool.close()
