"""Staging through host memory: device regions cross the socket in chunks, double-buffered.

A region whose bytes the CPU cannot address (CUDA memory) is registered with a :class:`StagedMemory`.
Sending its bytes, a :class:`Copier` copies chunk i+1 from the device into one host staging buffer while
chunk i goes out of the other; receiving, chunk i arrives in one buffer while chunk i-1 is copied to the
device from the other. The pipeline here knows nothing of CUDA: the copier hides the device. The CUDA copier
lives in :mod:`pdserve.transfer.cuda`; :class:`HostCopier` stages host memory (the CPU test double, and a
real copier for memory that must not be handed to the socket directly).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .errors import TransferError

Remaining = Callable[[], float]  # seconds left; raises TransferError once the batch ended or is overdue


class StagedMemory(ABC):
    """Memory moved through staging buffers. ``kind``/``device`` go into the segment descriptor."""

    kind = "cpu"
    device = 0
    addr = 0
    length = 0

    @property
    def device_key(self) -> tuple[str, int, type]:
        """Regions with the same key share copiers (one device, one copier type)."""
        return (self.kind, self.device, type(self))

    @abstractmethod
    def new_copier(self, chunk_bytes: int, buffers: int) -> Copier:
        """A copier for this memory's device with ``buffers`` host buffers of ``chunk_bytes`` each."""


Piece = tuple[StagedMemory, int, int]  # (memory, offset, length)
Part = memoryview | Piece  # a host view sent/received as is, or a piece that needs staging


class Copier(ABC):
    """Asynchronous copies between device pieces and numbered host staging buffers.

    ``to_host``/``to_device`` enqueue the copy of pieces (packed back to back in buffer j) and return at
    once; ``wait(j, timeout)`` blocks until every copy enqueued on buffer j finished, raising
    TransferError (``deadline`` when the timeout passed, ``device`` when a copy failed).
    """

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers

    @property
    def chunk_bytes(self) -> int:
        return self.buffers[0].nbytes

    @abstractmethod
    def to_host(self, j: int, pieces: Sequence[Piece]) -> None: ...

    @abstractmethod
    def to_device(self, j: int, pieces: Sequence[Piece]) -> None: ...

    @abstractmethod
    def wait(self, j: int, timeout: float) -> None: ...

    def close(self) -> None:
        pass


def plan_chunks(pieces: Sequence[Piece], chunk_bytes: int) -> list[list[Piece]]:
    """Cut pieces into chunks of at most ``chunk_bytes``; a piece larger than the room left is split."""
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    room = chunk_bytes
    for mem, offset, length in pieces:
        done = 0
        while done < length:
            take = min(room, length - done)
            current.append((mem, offset + done, take))
            done += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current:
        chunks.append(current)
    return chunks


def _size(chunk: Sequence[Piece]) -> int:
    return sum(n for _, _, n in chunk)


def send_staged(pieces: Sequence[Piece], copier: Copier, send: Callable[[memoryview], None],
                remaining: Remaining) -> None:
    """Copy pieces device->host chunk by chunk and ``send`` each chunk while the next one copies."""
    chunks = plan_chunks(pieces, copier.chunk_bytes)
    nbuf = len(copier.buffers)
    for i in range(min(nbuf - 1, len(chunks))):
        copier.to_host(i % nbuf, chunks[i])
    for i, chunk in enumerate(chunks):
        ahead = i + nbuf - 1
        if ahead < len(chunks):  # the buffer it lands in was sent (synchronously) last round
            copier.to_host(ahead % nbuf, chunks[ahead])
        j = i % nbuf
        copier.wait(j, remaining())
        send(copier.buffers[j][: _size(chunk)])


def recv_staged(pieces: Sequence[Piece], copier: Copier, recv: Callable[[memoryview], None],
                remaining: Remaining) -> None:
    """``recv`` each chunk into a host buffer, then copy it host->device while the next one arrives.
    Returns once every byte is on the device."""
    chunks = plan_chunks(pieces, copier.chunk_bytes)
    nbuf = len(copier.buffers)
    for i, chunk in enumerate(chunks):
        j = i % nbuf
        copier.wait(j, remaining())  # its previous host->device copy is done: the buffer is free
        recv(copier.buffers[j][: _size(chunk)])
        copier.to_device(j, chunk)
    for j in range(min(nbuf, len(chunks))):
        copier.wait(j, remaining())


def runs(parts: Sequence[Part]) -> list[tuple[bool, list[Any]]]:
    """Group parts into runs: (True, host views) or (False, pieces of one device), order kept."""
    out: list[tuple[bool, list[Any]]] = []
    for part in parts:
        host = isinstance(part, memoryview)
        key = None if isinstance(part, memoryview) else part[0].device_key
        if out and out[-1][0] == host and (host or out[-1][1][0][0].device_key == key):
            out[-1][1].append(part)
        else:
            out.append((host, [part]))
    return out


def send_parts(parts: Sequence[Part], pool: CopierPool, send: Callable[[list[memoryview]], None],
               remaining: Remaining) -> None:
    """Send parts in order: host views as they are, staged pieces through a borrowed copier."""
    for host, run in runs(parts):
        if host:
            send(run)
        else:
            with pool.borrow(run[0][0]) as copier:
                send_staged(run, copier, lambda v: send([v]), remaining)


def recv_parts(parts: Sequence[Part], pool: CopierPool, recv: Callable[[list[memoryview]], None],
               remaining: Remaining) -> None:
    """Receive into parts in order: host views directly, staged pieces through a borrowed copier."""
    for host, run in runs(parts):
        if host:
            recv(run)
        else:
            with pool.borrow(run[0][0]) as copier:
                recv_staged(run, copier, lambda v: recv([v]), remaining)


def all_host(parts: Sequence[Part]) -> bool:
    return all(isinstance(p, memoryview) for p in parts)


class CopierPool:
    """Idle copiers per device; a copier serves one lane or one request at a time. A copier that saw an
    error is closed rather than reused."""

    def __init__(self, chunk_bytes: int, buffers: int = 2) -> None:
        self.chunk_bytes = chunk_bytes
        self.nbuffers = buffers
        self._idle: dict[Any, list[Copier]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def borrow(self, memory: StagedMemory) -> Iterator[Copier]:
        key = memory.device_key
        with self._lock:
            idle = self._idle.setdefault(key, [])
            copier = idle.pop() if idle else None
        if copier is None:
            copier = memory.new_copier(self.chunk_bytes, self.nbuffers)
        try:
            yield copier
        except BaseException:
            copier.close()
            raise
        with self._lock:
            self._idle.setdefault(key, []).append(copier)

    def close(self) -> None:
        with self._lock:
            pools, self._idle = list(self._idle.values()), {}
        for idle in pools:
            for copier in idle:
                copier.close()


class HostMemory(StagedMemory):
    """Host bytes moved through staging buffers anyway (kind ``cpu``: peers may still address them
    directly). The CPU stand-in for device memory in tests of the staging path."""

    def __init__(self, view: memoryview, addr: int) -> None:
        self.view = view
        self.addr = addr
        self.length = view.nbytes

    def new_copier(self, chunk_bytes: int, buffers: int) -> HostCopier:
        return HostCopier(chunk_bytes, buffers)


class HostCopier(Copier):
    """Copies on one worker thread, in order, like a CUDA stream; ``_copy`` does one piece."""

    def __init__(self, chunk_bytes: int, buffers: int = 2) -> None:
        super().__init__([memoryview(bytearray(chunk_bytes)) for _ in range(buffers)])
        self._done = [threading.Event() for _ in range(buffers)]
        for ev in self._done:
            ev.set()
        self._errors: list[BaseException | None] = [None] * buffers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._worker, name="pdserve-te-hostcopy", daemon=True).start()

    def _copy(self, dst: memoryview, src: memoryview) -> None:
        dst[:] = src

    def _worker(self) -> None:
        while (job := self._jobs.get()) is not None:
            j, pieces, to_device = job
            try:
                pos = 0
                for mem, offset, length in pieces:
                    host = self.buffers[j][pos : pos + length]
                    dev = mem.view[offset : offset + length]  # type: ignore[attr-defined]
                    self._copy(dev, host) if to_device else self._copy(host, dev)
                    pos += length
            except BaseException as exc:  # reported by wait()
                self._errors[j] = exc
            self._done[j].set()

    def _enqueue(self, j: int, pieces: Sequence[Piece], to_device: bool) -> None:
        self._done[j].clear()
        self._jobs.put((j, list(pieces), to_device))

    def to_host(self, j: int, pieces: Sequence[Piece]) -> None:
        self._enqueue(j, pieces, False)

    def to_device(self, j: int, pieces: Sequence[Piece]) -> None:
        self._enqueue(j, pieces, True)

    def wait(self, j: int, timeout: float) -> None:
        if not self._done[j].wait(max(0.0, timeout)):
            raise TransferError("deadline", "staging copy did not finish before the deadline")
        err, self._errors[j] = self._errors[j], None
        if err is not None:
            raise TransferError("device", f"staging copy failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        self._jobs.put(None)
