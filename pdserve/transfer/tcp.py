"""Pure-Python TCP data path.

WRITE: each frame is one header (peer ranges) followed by the payload, sent with sendmsg straight
from the registered local ranges; the owner checks every range, then recvmsg_into's straight into
its registered memory. READ mirrors it. Frames are striped over several connections per peer.
"""

from __future__ import annotations

from typing import Any

from . import wire
from .backend import Backend, run_lanes, parse_entries
from .batch import BatchHandle, Op, TransferEntry, split_into_frames, stripe
from .connection import Connection
from .descriptor import SegmentDescriptor
from .server import Handler, OutOfStep, PeerContext


def _peer_rows(frame: list[TransferEntry]) -> list[list[Any]]:
    return [[e.peer_region, e.peer_offset, e.length] for e in frame]


class TcpBackend(Backend):
    name = "tcp"

    def supports(self, peer: SegmentDescriptor) -> bool:
        return True

    def run(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> None:
        lanes = stripe(split_into_frames(entries, self.ctx.config.slice_bytes), self.ctx.config.streams)
        job = self._write_lane if op is Op.WRITE else self._read_lane
        run_lanes(self.ctx, handle, peer.address, lanes, job)

    def _local_views(self, frame: list[TransferEntry]) -> list[memoryview]:
        return [self.ctx.regions.slice(e.local_region, e.local_offset, e.length) for e in frame]

    def _write_lane(self, conn: Connection, handle: BatchHandle, frames: list[list[TransferEntry]]) -> None:
        for frame in frames:
            conn.sock.settimeout(handle.remaining())
            header = {"t": "w", "b": handle.batch_id, "e": _peer_rows(frame)}
            wire.send_msg(conn.sock, header, self._local_views(frame), conn.max_iov)
        for _ in frames:
            conn.sock.settimeout(handle.remaining())
            wire.raise_if_error(wire.recv_msg(conn.sock))

    def _read_lane(self, conn: Connection, handle: BatchHandle, frames: list[list[TransferEntry]]) -> None:
        for frame in frames:
            conn.sock.settimeout(handle.remaining())
            wire.send_msg(conn.sock, {"t": "r", "b": handle.batch_id, "e": _peer_rows(frame)})
        for frame in frames:
            conn.sock.settimeout(handle.remaining())
            wire.raise_if_error(wire.recv_msg(conn.sock))
            wire.recv_into_views(conn.sock, self._local_views(frame), conn.max_iov)

    # ---- owner side ----
    def server_handlers(self) -> dict[str, Handler]:
        return {"w": self._serve_write, "r": self._serve_read}

    def _serve_write(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        try:
            rows = parse_entries(msg, 3)
        except Exception as exc:  # payload size unknown: the stream cannot be resynchronised
            raise OutOfStep("protocol", str(exc)) from exc
        try:
            views = [self.ctx.regions.slice(r, o, n) for r, o, n in rows]
        except Exception:
            wire.discard(ctx.sock, sum(n for _, _, n in rows))
            raise
        wire.recv_into_views(ctx.sock, views, self.ctx.config.max_iov)
        wire.send_msg(ctx.sock, {"t": "ok", "b": msg.get("b")})

    def _serve_read(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        rows = parse_entries(msg, 3)
        views = [self.ctx.regions.slice(r, o, n) for r, o, n in rows]
        wire.send_msg(ctx.sock, {"t": "d", "b": msg.get("b")}, views, self.ctx.config.max_iov)
