"""Same-host data path: one copy end to end with process_vm_readv/writev, no staging, no socket payload.
By default the initiator copies itself under the owner's grant (:mod:`pdserve.transfer.direct`: no request or
reply per batch); without a grant the memory owner copies between its registered range and the initiator's, one
request per frame.

CUDA regions on both sides move by CUDA IPC instead: the owner exports each CUDA region's IPC handle in
its descriptor, the initiator opens it once and copies device to device itself; the owner only gets the
notification. A batch mixing host and CUDA memory is not this backend's (``auto`` sends it over tcp,
which stages device memory through host buffers).

Requests travel on an abstract Unix socket, so the owner learns the initiator's pid from the
kernel (SO_PEERCRED) rather than trusting a claim; the owner bounds-checks its own ranges and the
initiator checks its own before asking.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import numpy as np

from . import direct, procmem, wire
from .backend import Backend, join_lanes, run_lanes
from .batch import BatchHandle, Op, TransferEntry, split_into_frames, stripe
from .connection import Address, Connection
from .descriptor import SegmentDescriptor
from .errors import TransferError
from .regions import Region
from .server import Handler, PeerContext

log = logging.getLogger(__name__)

_PROBE_BYTES = 32
_MIN_LANE_BYTES = 4 << 20  # below this a second parallel copy costs more than it saves
_CPUS = os.cpu_count() or 1


def _copy_request(kind: str, batch_id: str, frame: list[TransferEntry], addrs: dict[str, int]) -> dict[str, Any]:
    """Entries as columns: peer region names once, then one (name index, peer offset, length,
    our address) row of uint64 per entry, so neither side loops in Python over thousands of rows."""
    local_regions, local_offsets, peer_regions, peer_offsets, lengths = zip(*frame)
    names = list(dict.fromkeys(peer_regions))
    index = {name: i for i, name in enumerate(names)}
    cols = np.empty((len(frame), 4), dtype=np.uint64)
    cols[:, 0] = [index[name] for name in peer_regions]
    cols[:, 1] = peer_offsets
    cols[:, 2] = lengths
    cols[:, 3] = np.array([addrs[name] for name in local_regions], dtype=np.uint64) + np.array(
        local_offsets, dtype=np.uint64)
    return {"t": kind, "b": batch_id, "names": names, "cols": cols.tobytes()}


def _parse_copy_request(msg: dict[str, Any]) -> tuple[list[str], np.ndarray]:
    names, raw = msg.get("names"), msg.get("cols")
    if (not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names)
            or not isinstance(raw, bytes) or not raw or len(raw) % 32):
        raise TransferError("protocol", "copy request needs 'names' (region names) and 'cols' (n x 4 uint64)")
    cols = np.frombuffer(raw, dtype=np.uint64).reshape(-1, 4)
    if int(cols[:, 0].max()) >= len(names):
        raise TransferError("protocol", "copy request row names a region index out of range")
    return names, cols


class LocalBackend(Backend):
    name = "local"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._probe_token = ctypes.create_string_buffer(os.urandom(_PROBE_BYTES), _PROBE_BYTES)
        self._verdicts: dict[str, bool] = {}
        self._lock = threading.Lock()
        self.uds_name: str | None = None  # set by the engine once its server listens
        self._ipc: dict[str, list[Any]] = {}  # our CUDA regions' IPC records, by region name
        self._opened: Any = None  # peers' CUDA regions opened through IPC (cuda.IpcCache), made on first use
        self._issuer = direct.GrantIssuer()  # owner side: what same-host initiators may copy directly
        self._grants: dict[str, direct.Grant | None] = {}  # initiator side, by peer engine id (None: refused)

    def describe(self) -> dict[str, Any] | None:
        if not self.uds_name:
            return None
        with self._lock:
            ipc = dict(self._ipc)
        return {"uds": self.uds_name, "ipc": ipc} if ipc else {"uds": self.uds_name}

    def on_register(self, region: Region) -> None:
        if region.kind != "cuda":
            return
        from .cuda import CudaMemory, export_ipc

        if not isinstance(region.staged, CudaMemory):
            return
        try:
            record = export_ipc(region.staged)  # type: ignore[arg-type]
        except (RuntimeError, TypeError) as exc:  # e.g. memory not from torch's caching allocator
            log.info("region %r cannot be shared by CUDA IPC (%s); same-host peers stage it over tcp",
                     region.name, exc)
            return
        with self._lock:
            self._ipc[region.name] = record

    def on_unregister(self, region: Region) -> None:
        self._issuer.bump()  # grants naming it are stale: initiators fetch new ones before their next copy
        with self._lock:
            self._ipc.pop(region.name, None)

    def accepts(self, peer: SegmentDescriptor, entries: list[TransferEntry]) -> bool:
        """Host memory on both sides (process_vm), or CUDA on both sides with the peer's IPC records."""
        regions = self.ctx.regions
        peer_names = {e.peer_region for e in entries}  # per region, not per entry: batches hold thousands
        mine = {regions.get(name).kind for name in {e.local_region for e in entries}}
        theirs = {peer.memory(name)[0] for name in peer_names}
        if mine <= {"cpu"} and theirs <= {"cpu"}:
            return True
        shared = peer.backends.get("local", {}).get("ipc", {})
        return mine == theirs == {"cuda"} and peer_names <= set(shared)

    def control_address(self, peer: SegmentDescriptor) -> Address:
        return peer.backends["local"]["uds"]

    def supports(self, peer: SegmentDescriptor, timeout: float | None = None) -> bool:
        """Same kernel and PID namespace, a reachable Unix socket, and the copy permitted (probed once)."""
        if not peer.backends.get("local") or not peer.is_same_host(self.ctx.host_id):
            return False
        with self._lock:
            known = self._verdicts.get(peer.engine_id)
        if known is None:
            known = self._probe(peer, timeout)
            if known is None:  # out of time, not refused: no verdict kept, the next batch asks again
                return False
            with self._lock:
                self._verdicts[peer.engine_id] = known
        return known

    def _probe(self, peer: SegmentDescriptor, timeout: float | None) -> bool | None:
        """Whether this engine's owner-side copies reach ``peer``; None when the probe ran out of time."""
        msg = {"t": "lprobe", "addr": ctypes.addressof(self._probe_token), "n": _PROBE_BYTES}
        wait = self.ctx.config.connect_timeout_s if timeout is None else min(timeout, self.ctx.config.connect_timeout_s)
        try:
            reply = self.ctx.pool(self.control_address(peer)).call(msg, wait)
        except TransferError as exc:
            return None if exc.code == "deadline" or "timed out" in exc.message else False
        return reply.get("data") == self._probe_token.raw

    def run(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> None:
        # the engine chose this backend for these entries (choose_backend checked ``accepts``)
        if self.ctx.regions.get(entries[0].local_region).kind == "cuda":
            return self._run_ipc(handle, peer, op, entries)
        grant = self._grant(peer, handle) if self.ctx.config.local_direct else None
        if grant is not None:
            return self._run_direct(handle, grant, op, entries)
        config = self.ctx.config
        lanes = stripe(split_into_frames(entries, config.local_slice_bytes), self._lane_count(handle.total_bytes))
        kind = "lw" if op is Op.WRITE else "lr"

        addrs = {name: self.ctx.regions.get(name).addr for name in {e.local_region for e in entries}}

        def job(conn: Connection, h: BatchHandle, frames: list[list[TransferEntry]]) -> None:
            for frame in frames:  # ranges were bounds-checked by the engine at submit
                conn.sock.settimeout(h.remaining())
                wire.send_msg(conn.sock, _copy_request(kind, h.batch_id, frame, addrs))
            for frame in frames:  # the owner answers a lane's frames in order, each once its copy is done
                conn.sock.settimeout(h.remaining())
                wire.raise_if_error(wire.recv_msg(conn.sock))
                if op is Op.READ:
                    h.frame_arrived(frame)

        run_lanes(self.ctx, handle, self.control_address(peer), lanes, job)

    def run_now(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> bool:
        """Copy ``entries`` now, in the calling thread, when nothing has to be asked of the peer: direct copies on,
        its probe verdict and grant known, the grant current, host memory on both sides. False: not done (run the
        batch the usual way); raises TransferError when the copy failed."""
        if not self.ctx.config.local_direct or not entries:
            return False
        with self._lock:
            verdict, grant = self._verdicts.get(peer.engine_id), self._grants.get(peer.engine_id)
        if not verdict or grant is None or not peer.is_same_host(self.ctx.host_id) or not self.accepts(peer, entries):
            return False
        if self.ctx.regions.get(entries[0].local_region).kind != "cpu" or not direct.current(grant):
            return False
        self._run_direct(handle, grant, op, entries)
        return True

    def _grant(self, peer: SegmentDescriptor, handle: BatchHandle) -> direct.Grant | None:
        """The owner's grant, fetched once per peer and again once its epoch moved; None when it gives none."""
        with self._lock:
            known = self._grants.get(peer.engine_id, False)
        if known is None:
            return None
        if known is not False and direct.current(known):  # type: ignore[arg-type]
            return known  # type: ignore[return-value]
        try:
            reply = self.ctx.pool(self.control_address(peer)).call({"t": "lgrant"}, handle.remaining())
            grant: direct.Grant | None = direct.parse_grant(reply)
        except TransferError as exc:
            if exc.code not in ("protocol", "unavailable"):
                raise
            log.info("peer %s gives no direct-copy grant (%s); it copies for us", peer.engine_id, exc)
            grant = None
        with self._lock:
            self._grants[peer.engine_id] = grant
        return grant

    def _run_direct(self, handle: BatchHandle, grant: direct.Grant, op: Op, entries: list[TransferEntry]) -> None:
        """Copy under ``grant``: frames of ``local_slice_bytes`` (``piece_bytes`` for a READ with a frame hook, told
        each piece as it lands), dealt over as many parallel lanes as ``_lane_count`` allows."""
        config = self.ctx.config
        size = config.piece_bytes if handle.on_frame is not None and op is Op.READ else config.local_slice_bytes
        frames = [entries] if handle.total_bytes <= size else split_into_frames(entries, size)
        lanes = stripe(frames, self._lane_count(handle.total_bytes))
        pull = op is Op.READ

        def lane(frames: list[list[TransferEntry]]) -> None:
            for frame in frames:
                handle.remaining()  # raises once the batch is aborted or overdue
                direct.copy(grant, self.ctx.regions, frame, pull)
                if pull:
                    handle.frame_arrived(frame)

        join_lanes(handle, lambda: lane(lanes[0]), [self.ctx.executor.submit(lane, frames) for frames in lanes[1:]])

    def _run_ipc(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> None:
        from .cuda import IpcCache, device_copy

        with self._lock:
            if self._opened is None:
                self._opened = IpcCache()
            opened = self._opened
        records = peer.backends["local"]["ipc"]
        by_device: dict[int, list[tuple[Any, Any]]] = {}
        for e in entries:
            mine = self.ctx.regions.get(e.local_region)
            theirs = opened.get(peer.engine_id, e.peer_region, records[e.peer_region],
                                peer.region_length(e.peer_region))
            local = mine.staged.flat[e.local_offset : e.local_offset + e.length]  # type: ignore[union-attr]
            remote = theirs[e.peer_offset : e.peer_offset + e.length]
            pair = (remote, local) if op is Op.WRITE else (local, remote)
            by_device.setdefault(mine.device, []).append(pair)
        for device, pairs in by_device.items():
            device_copy(pairs, device, handle.remaining)

    def _lane_count(self, total: int) -> int:
        """No more parallel copies than cores to run them, and none for small batches, where a
        second copy costs more than it saves. Each lane still sends several frames, so the owner
        parses one frame while it copies another."""
        return max(1, min(self.ctx.config.streams, _CPUS, total // _MIN_LANE_BYTES))

    # ---- owner side ----
    def server_handlers(self) -> dict[str, Handler]:
        return {"lw": self._serve_copy, "lr": self._serve_copy, "lprobe": self._serve_probe,
                "lgrant": self._serve_grant}

    def _serve_grant(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        self._require_pid(ctx)  # a same-host peer, authenticated, on the Unix socket
        wire.send_msg(ctx.sock, self._issuer.message(self.ctx.regions))

    @staticmethod
    def _require_pid(ctx: PeerContext) -> int:
        if ctx.pid is None:
            raise TransferError("unavailable", "same-host copies are served on the Unix socket only")
        return ctx.pid

    def _serve_copy(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        pid = self._require_pid(ctx)
        names, cols = _parse_copy_request(msg)
        regions = [self.ctx.regions.get(name) for name in names]
        if any(r.kind != "cpu" for r in regions):
            raise TransferError("unavailable", "device memory cannot be copied with process_vm_readv/writev")
        index, offset, length, theirs = cols.T
        limit = np.array([r.length for r in regions], dtype=np.uint64)[index]
        bad = np.flatnonzero((offset > limit) | (length > limit - np.minimum(offset, limit)))
        if bad.size:
            i = int(bad[0])
            regions[int(index[i])].slice(int(offset[i]), int(length[i]))  # raises the precise error
        base = np.array([r.addr for r in regions], dtype=np.uint64)[index]
        mine = np.stack([base + offset, length], axis=1)
        procmem.copy(pid, mine, np.stack([theirs, length], axis=1), pull=msg["t"] == "lw")
        wire.send_msg(ctx.sock, {"t": "ok", "b": msg.get("b")})

    def _serve_probe(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        pid = self._require_pid(ctx)
        n, addr = msg.get("n"), msg.get("addr")
        if not isinstance(n, int) or not isinstance(addr, int) or not 0 < n <= 64:
            raise TransferError("protocol", "probe wants an int address and 1-64 bytes")
        buf = ctypes.create_string_buffer(n)
        procmem.copy(pid, procmem.iovecs([(ctypes.addressof(buf), n)]), procmem.iovecs([(addr, n)]), pull=True)
        wire.send_msg(ctx.sock, {"t": "ok", "data": buf.raw})
