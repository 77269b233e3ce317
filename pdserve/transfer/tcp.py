"""Pure-Python TCP data path.

WRITE: each frame is one header (peer ranges) followed by the payload, sent with sendmsg straight
from the registered local ranges; the owner checks every range, then recvmsg_into's straight into
its registered memory. READ mirrors it. Frames are striped over several connections per peer.

Device memory (CUDA) has no host view: its bytes cross the socket through double-buffered host staging
(:mod:`pdserve.transfer.staging`) on both sides; the wire is the same.
"""

from __future__ import annotations

from typing import Any

from . import wire
from .backend import Backend, parse_entries, run_lanes
from .batch import BatchHandle, Op, TransferEntry, cut_frames, split_into_frames, stripe, taper_sizes
from .connection import Connection
from .descriptor import SegmentDescriptor
from .errors import TransferError
from .server import Broken, Handler, OutOfStep, PeerContext
from .staging import Part, all_host, recv_parts, send_parts


def _peer_rows(frame: list[TransferEntry]) -> list[list[Any]]:
    return [[e.peer_region, e.peer_offset, e.length] for e in frame]


class TcpBackend(Backend):
    name = "tcp"

    def supports(self, peer: SegmentDescriptor, timeout: float | None = None) -> bool:
        return True

    def run(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> None:
        """A READ with ``on_frame`` moves the same frames as one without; the lane receives each frame in pieces of
        ``piece_bytes`` (its last frame's pieces halving down to ``tail_slice_bytes``) and tells the hook each piece
        as it lands, while it is still in this core's cache and the peer sends the rest."""
        config = self.ctx.config
        lanes = stripe(split_into_frames(entries, config.slice_bytes), config.streams)
        job = self._write_lane if op is Op.WRITE else self._read_lane
        run_lanes(self.ctx, handle, peer.address, lanes, job)

    def _local_parts(self, frame: list[TransferEntry]) -> list[Part]:
        regions = self.ctx.regions
        return [regions.get(e.local_region).part(e.local_offset, e.length) for e in frame]

    def _write_lane(self, conn: Connection, handle: BatchHandle, frames: list[list[TransferEntry]]) -> None:
        for frame in frames:
            conn.sock.settimeout(handle.remaining())
            header = {"t": "w", "b": handle.batch_id, "e": _peer_rows(frame)}
            parts = self._local_parts(frame)
            if all_host(parts):
                wire.send_msg(conn.sock, header, parts, conn.max_iov)  # type: ignore[arg-type]
            else:
                wire.send_msg(conn.sock, header)
                send_parts(parts, self.ctx.staging, lambda v: wire.send_views(conn.sock, v, conn.max_iov),
                           handle.remaining)
        for _ in frames:
            conn.sock.settimeout(handle.remaining())
            wire.raise_if_error(wire.recv_msg(conn.sock))

    def _read_lane(self, conn: Connection, handle: BatchHandle, frames: list[list[TransferEntry]]) -> None:
        for frame in frames:
            conn.sock.settimeout(handle.remaining())
            wire.send_msg(conn.sock, {"t": "r", "b": handle.batch_id, "e": _peer_rows(frame)})
        for i, frame in enumerate(frames):
            conn.sock.settimeout(handle.remaining())
            wire.raise_if_error(wire.recv_msg(conn.sock))
            pieces = self._pieces(handle, frame, i == len(frames) - 1)
            for piece in pieces:
                self._recv_into(conn, handle, self._local_parts(piece))
                handle.frame_arrived(piece)

    def _pieces(self, handle: BatchHandle, frame: list[TransferEntry], last: bool) -> list[list[TransferEntry]]:
        """How a read lane receives ``frame``: whole, or for a hook in pieces (``run``)."""
        if handle.on_frame is None:
            return [frame]
        config = self.ctx.config
        if not last:
            return split_into_frames(frame, config.piece_bytes)
        return cut_frames(frame, taper_sizes(sum(e.length for e in frame), config.piece_bytes, config.tail_slice_bytes))

    def _recv_into(self, conn: Connection, handle: BatchHandle, parts: list[Part]) -> None:
        if all_host(parts):
            wire.recv_into_views(conn.sock, parts, conn.max_iov)  # type: ignore[arg-type]
        else:
            recv_parts(parts, self.ctx.staging, lambda v: wire.recv_into_views(conn.sock, v, conn.max_iov),
                       handle.remaining)

    # ---- owner side ----
    def server_handlers(self) -> dict[str, Handler]:
        return {"w": self._serve_write, "r": self._serve_read}

    def _owner_remaining(self) -> float:
        return self.ctx.config.default_deadline_s

    def _owner_parts(self, rows: list[list[Any]]) -> list[Part]:
        regions = self.ctx.regions
        return [regions.get(r).part(o, n) for r, o, n in rows]

    def _serve_write(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        try:
            rows = parse_entries(msg, 3)
        except Exception as exc:  # payload size unknown: the stream cannot be resynchronised
            raise OutOfStep("protocol", str(exc)) from exc
        try:
            parts = self._owner_parts(rows)
        except Exception:
            wire.discard(ctx.sock, sum(n for _, _, n in rows))
            raise
        max_iov = self.ctx.config.max_iov
        if all_host(parts):
            wire.recv_into_views(ctx.sock, parts, max_iov)  # type: ignore[arg-type]
        else:
            try:
                recv_parts(parts, self.ctx.staging, lambda v: wire.recv_into_views(ctx.sock, v, max_iov),
                           self._owner_remaining)
            except TransferError as exc:  # part of the payload unread: report, then drop the connection
                raise OutOfStep(exc.code, exc.message) from exc
        wire.send_msg(ctx.sock, {"t": "ok", "b": msg.get("b")})

    def _serve_read(self, ctx: PeerContext, msg: dict[str, Any]) -> None:
        rows = parse_entries(msg, 3)
        parts = self._owner_parts(rows)
        max_iov = self.ctx.config.max_iov
        if all_host(parts):
            wire.send_msg(ctx.sock, {"t": "d", "b": msg.get("b")}, parts, max_iov)  # type: ignore[arg-type]
            return
        wire.send_msg(ctx.sock, {"t": "d", "b": msg.get("b")})
        try:
            send_parts(parts, self.ctx.staging, lambda v: wire.send_views(ctx.sock, v, max_iov),
                       self._owner_remaining)
        except TransferError as exc:  # the payload is half sent: no reply can follow, only a close
            raise Broken(exc.code, exc.message) from exc
