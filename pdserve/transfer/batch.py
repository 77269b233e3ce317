"""Batches of transfer entries: merging, slicing into frames, striping, and the handle callers poll."""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .errors import TransferError

log = logging.getLogger(__name__)


class Op(str, enum.Enum):
    WRITE = "write"  # local -> peer
    READ = "read"  # peer -> local


class BatchStatus(str, enum.Enum):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ABORTED = "aborted"


class TransferEntry(NamedTuple):
    """Move ``length`` bytes between local_region[local_offset:] and the peer's peer_region[peer_offset:].

    A named tuple: batches of thousands are built per request, so construction must be cheap.
    """

    local_region: str
    local_offset: int
    peer_region: str
    peer_offset: int
    length: int


FrameHook = Callable[[list[TransferEntry]], None]


def merge_contiguous(entries: Iterable[TransferEntry]) -> list[TransferEntry]:
    """Merge neighbours that are contiguous on both sides (same regions, both offsets adjacent)."""
    merged: list[TransferEntry] = []
    for e in entries:
        if e.length == 0:
            continue
        if merged:
            last = merged[-1]
            if (
                last.local_region == e.local_region and last.peer_region == e.peer_region
                and last.local_offset + last.length == e.local_offset
                and last.peer_offset + last.length == e.peer_offset
            ):
                merged[-1] = TransferEntry(last.local_region, last.local_offset, last.peer_region,
                                           last.peer_offset, last.length + e.length)
                continue
        merged.append(e)
    return merged


VECTOR_MIN = 64  # batches of this many entries or more are checked and merged with numpy, as columns


def merge_columns(rows: Sequence[Sequence[Any]], local_length: Callable[[str], int],
                  peer_length: Callable[[str], int]) -> list[TransferEntry] | None:
    """``merge_contiguous`` of ``rows`` (5-tuples) in a few numpy passes, once every range lies inside its region
    (``local_length``/``peer_length``: a region's length; they raise for an unknown one). None when a row is
    malformed or out of bounds: the caller's per-entry path then raises the precise error."""
    try:
        local_names, local_offsets, peer_names, peer_offsets, lengths = zip(*rows)
        local_ids = {x: i for i, x in enumerate(dict.fromkeys(local_names))}
        peer_ids = {x: i for i, x in enumerate(dict.fromkeys(peer_names))}
    except (TypeError, ValueError):
        return None
    lo, po, n = (np.array(c) for c in (local_offsets, peer_offsets, lengths))
    if any(a.dtype.kind != "i" for a in (lo, po, n)):
        return None  # floats, bools, ints past 64 bits: the per-entry path says what is wrong
    li = np.array([local_ids[x] for x in local_names])
    pi = np.array([peer_ids[x] for x in peer_names])
    local_limit = np.array([local_length(x) for x in local_ids], dtype=np.int64)[li]
    peer_limit = np.array([peer_length(x) for x in peer_ids], dtype=np.int64)[pi]
    if ((lo < 0) | (po < 0) | (n < 0) | (lo > local_limit - n) | (po > peer_limit - n)).any():
        return None
    keep = np.flatnonzero(n > 0)
    lo, po, n, li, pi = lo[keep], po[keep], n[keep], li[keep], pi[keep]
    joined = np.zeros(len(keep), dtype=bool)
    joined[1:] = (li[1:] == li[:-1]) & (pi[1:] == pi[:-1]) & (lo[:-1] + n[:-1] == lo[1:]) & (po[:-1] + n[:-1] == po[1:])
    starts = np.flatnonzero(~joined)
    if not len(starts):
        return []
    runs = np.add.reduceat(n, starts).tolist()
    first = keep[starts].tolist()
    columns = ([local_names[i] for i in first], [local_offsets[i] for i in first], [peer_names[i] for i in first],
               [peer_offsets[i] for i in first], runs)
    return list(map(_new_entry, zip(*columns)))


def _new_entry(row: tuple[Any, ...]) -> TransferEntry:
    """A TransferEntry from a 5-tuple without NamedTuple's Python-level ``__new__`` (thousands per batch)."""
    return tuple.__new__(TransferEntry, row)  # type: ignore[type-var]


def split_into_frames(entries: list[TransferEntry], slice_bytes: int) -> list[list[TransferEntry]]:
    """Cut entries into frames of at most ``slice_bytes`` bytes; large entries are split across frames."""
    return cut_frames(entries, itertools.repeat(slice_bytes))


def cut_frames(entries: list[TransferEntry], sizes: Iterable[int]) -> list[list[TransferEntry]]:
    """Cut entries, in order, into consecutive frames of the next of ``sizes`` bytes each (the last frame may be
    shorter); large entries are split across frames."""
    sizes = iter(sizes)
    frames: list[list[TransferEntry]] = []
    current: list[TransferEntry] = []
    room = next(sizes)
    for e in entries:
        if e.length <= room:  # common case: the entry fits whole, no new object
            current.append(e)
            room -= e.length
            if room == 0:
                frames.append(current)
                current, room = [], next(sizes, 1 << 62)
            continue
        done = 0
        while done < e.length:
            take = min(room, e.length - done)
            current.append(TransferEntry(e.local_region, e.local_offset + done, e.peer_region,
                                         e.peer_offset + done, take))
            done += take
            room -= take
            if room == 0:
                frames.append(current)
                current, room = [], next(sizes, 1 << 62)
    if current:
        frames.append(current)
    return frames


def taper_sizes(total: int, cap: int, tail: int) -> list[int]:
    """Sizes that cover ``total`` bytes, largest first, halving towards the end down to ``tail`` (the last two are
    ``tail``): ..., 4t, 2t, t, t. Whoever reads the pieces as they arrive (a checksum) keeps up with the transfer
    and has only the last, small piece left when the transfer ends."""
    sizes: list[int] = []
    size, left = tail, total
    while left > 0:
        take = min(size, left)
        sizes.append(take)
        left -= take
        if len(sizes) >= 2:
            size = min(cap, size * 2)
    return sizes[::-1]


def stripe(frames: list[list[TransferEntry]], streams: int) -> list[list[list[TransferEntry]]]:
    """Deal frames round-robin over at most ``streams`` lanes (frames are near-equal in size)."""
    lanes = min(streams, len(frames))
    return [frames[i::lanes] for i in range(lanes)] if lanes else []


class BatchHandle:
    """Status of one submitted batch: poll, wait with a timeout, or abort.

    The batch fails by its deadline at the latest: workers bound every socket wait by it, and
    ``wait`` marks an overdue batch failed and interrupts its connections.

    A batch that no engine thread has started yet is run by the first thread that waits for it without a timeout
    (``wait()``, ``result()``): a caller that submits and then waits pays no hand-off to another thread and back.
    """

    def __init__(self, batch_id: str, op: Op, total_bytes: int, deadline: float) -> None:
        self.batch_id = batch_id
        self.op = op
        self.total_bytes = total_bytes
        self.deadline = deadline
        self.started = time.monotonic()
        self.finished: float | None = None
        self._status = BatchStatus.PENDING
        self._error: TransferError | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._interrupts: dict[int, Callable[[], None]] = {}
        self.reply: Any = None  # the peer's answer to the batch's notification (TransferEngine.on_notify)
        self.on_frame: FrameHook | None = None  # READ: told each frame once its bytes are in local memory
        self._job: Callable[[], None] | None = None  # the work, until a thread claims it

    def attach(self, job: Callable[[], None]) -> None:
        """The work that moves this batch; whichever thread claims it first runs it (engine thread or waiter)."""
        self._job = job

    def run_claimed(self) -> None:
        """Run the batch's work here unless another thread claimed it already."""
        with self._lock:
            job, self._job = self._job, None
        if job is not None:
            job()

    def frame_arrived(self, frame: list[TransferEntry]) -> None:
        """A data path read ``frame`` (its local ranges now hold the peer's bytes): tell ``on_frame``. A hook that
        fails is logged and never fails the transfer."""
        hook = self.on_frame
        if hook is None:
            return
        try:
            hook(frame)
        except Exception:
            log.exception("batch %s: frame hook failed", self.batch_id)

    # ---- caller side ----
    def poll(self) -> BatchStatus:
        if self._status is BatchStatus.PENDING and time.monotonic() > self.deadline:
            self.fail(TransferError("deadline", f"batch {self.batch_id} missed its deadline"))
        return self._status

    def wait(self, timeout: float | None = None) -> BatchStatus:
        """Block until done, the deadline, or ``timeout`` seconds; return the status then. Without a timeout, a batch
        that no engine thread has started yet runs in this thread."""
        if timeout is None and self._job is not None:
            self.run_claimed()
        limit = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        self._done.wait(max(0.0, limit - time.monotonic()))
        return self.poll()

    def result(self, timeout: float | None = None) -> None:
        """Wait, then raise the batch's error unless it succeeded."""
        status = self.wait(timeout)
        if status is BatchStatus.PENDING:
            raise TimeoutError(f"batch {self.batch_id} still pending after {timeout} s")
        if status is not BatchStatus.SUCCEEDED:
            raise self._error or TransferError(status.value, f"batch {self.batch_id} {status.value}")

    def abort(self) -> None:
        self._finish(BatchStatus.ABORTED, TransferError("aborted", f"batch {self.batch_id} aborted"))

    @property
    def error(self) -> TransferError | None:
        return self._error

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    # ---- worker side ----
    @property
    def active(self) -> bool:
        return self._status is BatchStatus.PENDING

    def remaining(self) -> float:
        """Seconds left before the deadline; raise once it has passed or the batch has ended."""
        if not self.active:
            raise self._error or TransferError("aborted", f"batch {self.batch_id} already ended")
        left = self.deadline - time.monotonic()
        if left <= 0:
            err = TransferError("deadline", f"batch {self.batch_id} missed its deadline")
            self.fail(err)
            raise err
        return left

    def add_interrupt(self, key: int, fn: Callable[[], None]) -> None:
        with self._lock:
            self._interrupts[key] = fn
        if not self.active:
            fn()

    def remove_interrupt(self, key: int) -> None:
        with self._lock:
            self._interrupts.pop(key, None)

    def succeed(self) -> None:
        self._finish(BatchStatus.SUCCEEDED, None)

    def fail(self, error: TransferError) -> None:
        self._finish(BatchStatus.FAILED, error)

    def _finish(self, status: BatchStatus, error: TransferError | None) -> None:
        with self._lock:
            if self._status is not BatchStatus.PENDING:
                return
            self._status, self._error = status, error
            self.finished = time.monotonic()
            interrupts = list(self._interrupts.values()) if error else []
        self._done.set()
        for fn in interrupts:
            fn()
