"""What every data path (tcp, local, mooncake, nixl) implements, and the striping they share."""

from __future__ import annotations

import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .batch import BatchHandle, Op, TransferEntry
from .config import TransferConfig
from .connection import Address, Connection, PeerPool
from .descriptor import SegmentDescriptor
from .errors import TransferError
from .regions import Region, RegionTable
from .server import Handler
from .staging import CopierPool


@dataclass
class EngineContext:
    """The parts of an engine that backends use."""

    config: TransferConfig
    engine_id: str
    host_id: str
    pid: int
    regions: RegionTable
    executor: ThreadPoolExecutor
    staging: CopierPool = field(default_factory=lambda: CopierPool(1 << 20))
    _pools: dict[Any, PeerPool] = field(default_factory=dict)
    _pools_lock: threading.Lock = field(default_factory=threading.Lock)

    def pool(self, address: Address) -> PeerPool:
        with self._pools_lock:
            pool = self._pools.get(address)
            if pool is None:
                # one extra slot so a notification never waits behind the data streams
                pool = self._pools[address] = PeerPool(address, self.config, self.config.streams + 1)
            return pool

    def close_pools(self) -> None:
        with self._pools_lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
        self.staging.close()


class Backend(ABC):
    """A data path. ``run`` moves a batch's (already merged, bounds-checked) entries or raises."""

    name = "backend"

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def describe(self) -> dict[str, Any] | None:
        """What peers need to reach this backend (goes into the segment descriptor)."""
        return {}

    def server_handlers(self) -> dict[str, Handler]:
        return {}

    def on_register(self, region: Region) -> None:
        pass

    def on_unregister(self, region: Region) -> None:
        pass

    @abstractmethod
    def supports(self, peer: SegmentDescriptor, timeout: float | None = None) -> bool:
        """True when this backend can reach ``peer`` (asking it at most ``timeout`` seconds, when it must ask)."""

    def accepts(self, peer: SegmentDescriptor, entries: list[TransferEntry]) -> bool:
        """True when this backend can move these entries' memory kinds (checked by ``auto``)."""
        return True

    @abstractmethod
    def run(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> None:
        """Move the bytes, bounded by handle's deadline; raise TransferError on any failure."""

    def control_address(self, peer: SegmentDescriptor) -> Address:
        """Where notifications for batches of this backend go."""
        return peer.address

    def close(self) -> None:
        pass


LaneJob = Callable[[Connection, BatchHandle, list[list[TransferEntry]]], None]


def _lane_error(handle: BatchHandle, exc: OSError) -> TransferError:
    if not handle.active and handle.error is not None:
        return handle.error
    if isinstance(exc, socket.timeout):
        return TransferError("deadline", f"batch {handle.batch_id}: peer stalled past the deadline")
    return TransferError("peer", f"batch {handle.batch_id}: connection to peer failed: {exc}")


@contextmanager
def batch_connection(ctx: EngineContext, handle: BatchHandle, address: Address) -> Iterator[Connection]:
    """A pooled connection for one batch: interrupted if the batch ends early, returned to the
    pool only if the work inside succeeded, socket errors turned into TransferError."""
    pool = ctx.pool(address)
    conn = pool.acquire(handle.remaining())
    handle.add_interrupt(id(conn), conn.interrupt)
    healthy = False
    try:
        yield conn
        healthy = True
    except OSError as exc:
        raise _lane_error(handle, exc) from exc
    finally:
        handle.remove_interrupt(id(conn))
        pool.release(conn, healthy and handle.active)


def _run_lane(ctx: EngineContext, handle: BatchHandle, address: Address,
              lane: list[list[TransferEntry]], job: LaneJob) -> None:
    with batch_connection(ctx, handle, address) as conn:
        job(conn, handle, lane)


def run_lanes(ctx: EngineContext, handle: BatchHandle, address: Address,
              lanes: list[list[list[TransferEntry]]], job: LaneJob) -> None:
    """Run each lane on its own pooled connection in parallel; raise the first lane's error.
    The first lane runs in the calling thread, so a one-lane batch pays no thread hand-off."""
    futures = [ctx.executor.submit(_run_lane, ctx, handle, address, lane, job) for lane in lanes[1:]]
    join_lanes(handle, lambda: _run_lane(ctx, handle, address, lanes[0], job), futures)


def join_lanes(handle: BatchHandle, first_lane: Callable[[], None], others: list[Future[Any]]) -> None:
    """Run ``first_lane`` here while ``others`` run on the engine's threads, then wait for them all; the first
    TransferError fails the batch at once (the other lanes stop before their next frame) and is raised."""
    first: TransferError | None = None
    try:
        first_lane()
    except TransferError as exc:
        first = exc
        handle.fail(exc)
    for fut in others:
        try:
            fut.result()
        except TransferError as exc:
            if first is None:
                first = exc
                handle.fail(exc)
    if first is not None:
        raise first


def parse_entries(msg: dict[str, Any], width: int) -> list[list[Any]]:
    """Validate the shape of a request's entry list: [region, offset, length, *extra] rows."""
    rows = msg.get("e")
    if not isinstance(rows, list) or not rows:
        raise TransferError("protocol", "request carries no entry list 'e'")
    for row in rows:
        if type(row) is not list or len(row) != width or type(row[0]) is not str:
            raise TransferError("protocol", f"malformed entry {row!r}: want [region, offset, length, ...]")
        for x in row[1:]:
            if type(x) is not int or x < 0:
                raise TransferError("protocol", f"malformed entry {row!r}: offsets and lengths are ints >= 0")
    return rows
