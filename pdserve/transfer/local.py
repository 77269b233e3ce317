"""Same-host data path: the memory owner copies directly between its registered range and the
initiator's, with process_vm_readv/writev (one copy end to end, no staging, no socket payload).

Requests travel on an abstract Unix socket, so the owner learns the initiator's pid from the
kernel (SO_PEERCRED) rather than trusting a claim; the owner bounds-checks its own ranges and the
initiator checks its own before asking.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from . import procmem, wire
from .backend import Backend, parse_entries, region_addresses, run_lanes
from .batch import BatchHandle, Op, TransferEntry, split_into_frames, stripe
from .connection import Address, Connection
from .descriptor import SegmentDescriptor
from .errors import TransferError
from .server import Handler, PeerContext

_PROBE_BYTES = 32
_MIN_LANE_BYTES = 4 << 20  # below this a second parallel copy costs more than it saves


class LocalBackend(Backend):
    name = "local"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._probe_token = ctypes.create_string_buffer(os.urandom(_PROBE_BYTES), _PROBE_BYTES)
        self._verdicts: dict[str, bool] = {}
        self._lock = threading.Lock()
        self.uds_name: str | None = None  # set by the engine once its server listens

    def describe(self) -> dict[str, Any] | None:
        return {"uds": self.uds_name} if self.uds_name else None

    def control_address(self, peer: SegmentDescriptor) -> Address:
        return peer.backends["local"]["uds"]

    def supports(self, peer: SegmentDescriptor) -> bool:
        """Same kernel and PID namespace, a reachable Unix socket, and the copy permitted (probed once)."""
        if not peer.backends.get("local") or not peer.is_same_host(self.ctx.host_id):
            return False
        with self._lock:
            known = self._verdicts.get(peer.engine_id)
        if known is None:
            known = self._probe(peer)
            with self._lock:
                self._verdicts[peer.engine_id] = known
        return known

    def _probe(self, peer: SegmentDescriptor) -> bool:
        pool = self.ctx.pool(self.control_address(peer))
        try:
            conn = pool.acquire(self.ctx.config.connect_timeout_s)
        except TransferError:
            return False
        ok = False
        try:
            msg = {"t": "lprobe", "addr": ctypes.addressof(self._probe_token), "n": _PROBE_BYTES}
            reply = conn.call(msg, self.ctx.config.connect_timeout_s)
            ok = reply.get("data") == self._probe_token.raw
        except (OSError, TransferError):
            pass
        finally:
            pool.release(conn, ok)
        return ok

    def run(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> None:
        lanes = stripe(split_into_frames(entries, self._lane_bytes(entries)), self.ctx.config.streams)
        kind = "lw" if op is Op.WRITE else "lr"

        addrs = {name: self.ctx.regions.get(name).addr for name in {e.local_region for e in entries}}

        def job(conn: Connection, h: BatchHandle, frames: list[list[TransferEntry]]) -> None:
            for frame in frames:  # ranges were bounds-checked by the engine at submit
                conn.sock.settimeout(h.remaining())
                rows = [[e.peer_region, e.peer_offset, e.length, addrs[e.local_region] + e.local_offset]
                        for e in frame]
                wire.send_msg(conn.sock, {"t": kind, "b": h.batch_id, "e": rows})
            for _ in frames:
                conn.sock.settimeout(h.remaining())
                wire.raise_if_error(wire.recv_msg(conn.sock))

        run_lanes(self.ctx, handle, self.control_address(peer), lanes, job)

    def _lane_bytes(self, entries: list[TransferEntry]) -> int:
        """One request per parallel copy: the owner copies a whole lane with few system calls, and
        no more copies run at once than there are cores to run them."""
        total = sum(e.length for e in entries)
        lanes = max(1, min(self.ctx.config.streams, os.cpu_count() or 1, total // _MIN_LANE_BYTES))
        return max(4096, -(-total // lanes))

    # ---- owner side ----
    def server_handlers(self) -> dict[str, Handler]:
        return {"lw": self._serve_copy, "lr": self._serve_copy, "lprobe": self._serve_probe}

    @staticmethod
    def _require_pid(ctx: PeerContext) -> int:
        if ctx.pid is None:
            raise TransferError("unavailable", "same-host copies are served on the Unix socket only")
        return ctx.pid

    def _serve_copy(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        pid = self._require_pid(ctx)
        rows = parse_entries(msg, 4)
        mine = region_addresses(self.ctx.regions, rows)
        theirs = [(row[3], row[2]) for row in rows]
        procmem.copy(pid, mine, theirs, pull=msg["t"] == "lw")
        wire.send_msg(ctx.sock, {"t": "ok", "b": msg.get("b")})

    def _serve_probe(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        pid = self._require_pid(ctx)
        n, addr = msg.get("n"), msg.get("addr")
        if not isinstance(n, int) or not isinstance(addr, int) or not 0 < n <= 64:
            raise TransferError("protocol", "probe wants an int address and 1-64 bytes")
        buf = ctypes.create_string_buffer(n)
        procmem.copy(pid, [(ctypes.addressof(buf), n)], [(addr, n)], pull=True)
        wire.send_msg(ctx.sock, {"t": "ok", "data": buf.raw})
