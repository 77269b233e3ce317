"""The transfer engine: one per process. Register memory, publish a segment descriptor, submit
batches of (local range, peer range) entries as WRITE or READ, poll/wait/abort them, and receive
the small notifications peers attach to their batches."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from . import wire
from .backend import Backend, EngineContext, batch_connection
from .batch import VECTOR_MIN, BatchHandle, FrameHook, Op, TransferEntry, merge_columns, merge_contiguous
from .config import TransferConfig
from .descriptor import SegmentDescriptor, host_identity
from .errors import TransferError
from .local import LocalBackend
from .regions import Region, RegionTable
from .server import ControlServer, Handler, PeerContext
from .staging import CopierPool
from .tcp import TcpBackend

log = logging.getLogger(__name__)
EntryLike = TransferEntry | Sequence[Any]
PeerLike = SegmentDescriptor | dict


class Notification(NamedTuple):
    peer_engine_id: str
    batch_id: str
    message: Any  # bytes or str, as the peer sent it
    nbytes: int = 0  # bytes the peer's batch moved before it notified (0: a notification alone)


def _optional_backend(name: str) -> type[Backend]:
    if name == "mooncake":
        from .mooncake import MooncakeBackend
        return MooncakeBackend
    from .nixl import NixlBackend
    return NixlBackend


class TransferEngine:
    """Batched, bounds-checked, authenticated memory transfers between processes."""

    def __init__(self, config: TransferConfig | None = None, engine_id: str | None = None) -> None:
        self.config = config or TransferConfig()
        self.engine_id = engine_id or uuid.uuid4().hex[:16]
        self._regions = RegionTable()
        self._executor = ThreadPoolExecutor(max_workers=4 * self.config.streams + 8,
                                            thread_name_prefix="pdserve-te")
        # batches run on their own pool: they wait on lanes, which run on self._executor
        self._batch_runner = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdserve-te-batch")
        self.ctx = EngineContext(self.config, self.engine_id, host_identity(), os.getpid(),
                                 self._regions, self._executor, CopierPool(self.config.staging_chunk_bytes))
        self._backends: dict[str, Backend] = {"tcp": TcpBackend(self.ctx), "local": LocalBackend(self.ctx)}
        if self.config.backend in ("mooncake", "nixl"):
            self._backends[self.config.backend] = _optional_backend(self.config.backend)(self.ctx)
        handlers: dict[str, Handler] = {"n": self._serve_notify, "seg": self._serve_segment}
        for backend in self._backends.values():
            handlers.update(backend.server_handlers())
        self._server = ControlServer(self.config, handlers, f"pdserve-te-{self.engine_id}")
        self._backends["local"].uds_name = self._server.uds_name  # type: ignore[attr-defined]
        self._ids = itertools.count()
        self._inbox: deque[Notification] = deque()
        self._inbox_lock = threading.Lock()
        self._callbacks: list[Callable[[Notification], None]] = []

    # ---- memory ----
    def register(self, name: str, buffer: Any) -> Region:
        """Expose ``buffer`` to peers as region ``name``: a numpy array, a CPU or CUDA tensor (dense: contiguous
        up to a permutation of its dims; offsets address its bytes in memory order), an mmap, a bytearray,
        or a :class:`~pdserve.transfer.staging.StagedMemory`."""
        region = self._regions.register(name, buffer)
        done: list[Backend] = []
        try:
            for backend in self._backends.values():
                backend.on_register(region)
                done.append(backend)
        except BaseException:  # a backend refused it: no half-registered region stays behind
            for backend in done:
                backend.on_unregister(region)
            self._regions.unregister(name)
            raise
        return region

    def unregister(self, name: str) -> None:
        region = self._regions.get(name)
        for backend in self._backends.values():
            backend.on_unregister(region)
        self._regions.unregister(name)

    def segment(self) -> SegmentDescriptor:
        backends = {n: d for n, b in self._backends.items() if (d := b.describe()) is not None}
        return SegmentDescriptor(self.engine_id, self.config.advertise_host or self.config.host,
                                 self._server.port, os.getpid(), self.ctx.host_id,
                                 self._regions.describe(), backends)

    def fetch_segment(self, host: str, port: int, timeout: float | None = None) -> SegmentDescriptor:
        """Ask the engine listening at host:port for its current descriptor."""
        wait = timeout or self.config.connect_timeout_s
        reply = self.ctx.pool((host, port)).call({"t": "seg"}, wait)
        return SegmentDescriptor.from_wire(reply.get("seg"))

    # ---- transfers ----
    def submit(self, peer: PeerLike, entries: Iterable[EntryLike], op: Op | str = Op.WRITE,
               notify: bytes | str | None = None, deadline_s: float | None = None,
               backend: str | None = None, on_frame: FrameHook | None = None) -> BatchHandle:
        """Start a batch; return at once with its handle. Bad ranges raise here, synchronously.

        The batch runs on an engine thread, or in the thread that waits for it without a timeout if that comes first
        (:meth:`BatchHandle.wait`); a small same-host batch without ``notify`` or ``on_frame`` to a peer already
        granted is copied here and returned finished (``TransferConfig.inline_bytes``).

        ``on_frame`` (READ): called on a transfer thread with each frame's entries once their bytes are in local
        memory (tcp and local paths; others, and CUDA IPC, call it never), before the notification is sent: so a
        caller may check the bytes while the rest is still moving. It must be quick (hand the work to a thread)."""
        peer = peer if isinstance(peer, SegmentDescriptor) else SegmentDescriptor.from_wire(peer)
        op = Op(op)
        merged = self._merged(peer, entries)
        seconds = self.config.default_deadline_s if deadline_s is None else deadline_s
        handle = BatchHandle(f"{self.engine_id}:{next(self._ids)}", op, sum(e.length for e in merged),
                             time.monotonic() + seconds)
        handle.on_frame = on_frame
        if notify is None and on_frame is None and 0 < handle.total_bytes <= self.config.inline_bytes \
                and self._run_now(handle, peer, op, merged, backend):
            return handle
        handle.attach(lambda: self._execute(handle, peer, op, merged, notify, backend))
        self._batch_runner.submit(handle.run_claimed)
        return handle

    def _run_now(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry],
                 requested: str | None) -> bool:
        """A small same-host batch copied inside ``submit`` (``TransferConfig.inline_bytes``); False: not here."""
        if (requested or self.config.backend) not in ("auto", "local"):
            return False
        local = self._backends["local"]
        try:
            if not local.run_now(handle, peer, op, entries):  # type: ignore[attr-defined]
                return False
        except TransferError as exc:
            handle.fail(exc)
            return True
        handle.succeed()
        return True

    def write(self, peer: PeerLike, entries: Iterable[EntryLike], notify: bytes | str | None = None,
              deadline_s: float | None = None) -> BatchHandle:
        """Submit a WRITE batch and wait for it; raise TransferError on failure."""
        handle = self.submit(peer, entries, Op.WRITE, notify, deadline_s)
        handle.result()
        return handle

    def read(self, peer: PeerLike, entries: Iterable[EntryLike], notify: bytes | str | None = None,
             deadline_s: float | None = None) -> BatchHandle:
        """Submit a READ batch and wait for it; raise TransferError on failure."""
        handle = self.submit(peer, entries, Op.READ, notify, deadline_s)
        handle.result()
        return handle

    def _merged(self, peer: SegmentDescriptor, entries: Iterable[EntryLike]) -> list[TransferEntry]:
        """Entries checked against our regions and the peer's, contiguous neighbours merged: as columns for large
        batches (one numpy pass, no per-entry Python but the merged entries'), entry by entry otherwise and for
        whatever the columns refuse (which raises the precise error)."""
        rows = entries if isinstance(entries, list) else list(entries)
        if len(rows) >= VECTOR_MIN:
            merged = merge_columns(rows, lambda name: self._regions.get(name).length, peer.region_length)
            if merged is not None:
                return merged
        return merge_contiguous(self._checked(peer, rows))

    def _checked(self, peer: SegmentDescriptor, entries: Iterable[EntryLike]) -> list[TransferEntry]:
        """Entries as TransferEntry, every range checked against our regions and the peer's."""
        out = [e if isinstance(e, TransferEntry) else TransferEntry(*e) for e in entries]
        mine = {name: self._regions.get(name).length for name in {e.local_region for e in out}}
        theirs = {name: peer.region_length(name) for name in {e.peer_region for e in out}}
        for e in out:
            if (e.local_offset < 0 or e.length < 0 or e.local_offset + e.length > mine[e.local_region]
                    or e.peer_offset < 0 or e.peer_offset + e.length > theirs[e.peer_region]):
                self._regions.slice(e.local_region, e.local_offset, e.length)  # raises the precise error
                peer.check(e.peer_region, e.peer_offset, e.length)
        return out

    def choose_backend(self, peer: SegmentDescriptor, requested: str | None = None,
                       entries: list[TransferEntry] | None = None, timeout: float | None = None) -> Backend:
        """The backend for ``peer`` (and ``entries``' memory kinds); a first contact asks the peer for at most
        ``timeout`` seconds (the batch's time left)."""
        name = requested or self.config.backend
        if name == "auto":
            local = self._backends["local"]
            usable = local.supports(peer, timeout) and (entries is None or local.accepts(peer, entries))
            return local if usable else self._backends["tcp"]
        backend = self._backends.get(name)
        if backend is None:
            raise TransferError("config", f"backend {name!r} not enabled in this engine's config")
        if not backend.supports(peer, timeout) or (entries is not None and not backend.accepts(peer, entries)):
            raise TransferError("unavailable", f"backend {name!r} cannot reach peer {peer.engine_id}")
        return backend

    def _execute(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op,
                 entries: list[TransferEntry], notify: Any, requested: str | None) -> None:
        try:
            backend = self.choose_backend(peer, requested, entries, handle.remaining())
            if entries:
                backend.run(handle, peer, op, entries)
            if notify is not None:
                with batch_connection(self.ctx, handle, backend.control_address(peer)) as conn:
                    reply = conn.call({"t": "n", "b": handle.batch_id, "from": self.engine_id, "m": notify,
                                       "nb": handle.total_bytes}, handle.remaining())
                handle.reply = reply.get("r")
            handle.succeed()
        except TransferError as exc:
            if exc.code != "deadline" and time.monotonic() >= handle.deadline:  # it ran out of time on the way
                exc = TransferError("deadline", f"batch {handle.batch_id} missed its deadline ({exc.message})")
            handle.fail(exc)
        except Exception as exc:  # never leave a batch pending on a bug
            log.exception("batch %s crashed", handle.batch_id)
            handle.fail(TransferError("internal", f"{type(exc).__name__}: {exc}"))

    # ---- notifications ----
    def on_notify(self, callback: Callable[[Notification], Any]) -> None:
        """Call ``callback`` (on an engine thread) for every notification that arrives. The first callback that
        returns something other than None answers the notification: that msgpack-able value reaches the sender
        as its batch handle's ``reply`` (e.g. checksums of the bytes the batch read), in the same round trip."""
        self._callbacks.append(callback)

    def get_notifications(self) -> list[Notification]:
        """Drain and return the notifications received so far."""
        with self._inbox_lock:
            items, self._inbox = list(self._inbox), deque()
        return items

    def _serve_notify(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        nbytes = msg.get("nb")
        note = Notification(str(msg.get("from")), str(msg.get("b")), msg.get("m"),
                            nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) else 0)
        with self._inbox_lock:
            self._inbox.append(note)
        answer = None
        for callback in list(self._callbacks):
            try:
                out = callback(note)
            except Exception:
                log.exception("notification callback failed")
                continue
            if answer is None:
                answer = out
        wire.send_msg(ctx.sock, {"t": "ok"} if answer is None else {"t": "ok", "r": answer})

    def _serve_segment(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        wire.send_msg(ctx.sock, {"t": "ok", "seg": self.segment().to_wire()})

    # ---- lifecycle ----
    def close(self) -> None:
        self._server.close()
        self.ctx.close_pools()
        for backend in self._backends.values():
            backend.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._batch_runner.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
