"""Owner side: accept authenticated connections and dispatch their requests to handlers.

The server listens on TCP (host:port from the config) and, for peers on the same host, on an
abstract Unix socket whose kernel-reported peer credentials identify the peer process.
A handler gets (PeerContext, message), does the work (bounds-checked against this process's
regions) and sends its reply. A handler that rejects a request raises TransferError after
consuming the request's payload, so the connection stays usable; OutOfStep or anything else
closes that connection only. The process and its other connections go on.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import wire
from .config import TransferConfig
from .connection import tune
from .errors import TransferError
from .listener import ThreadedListener

log = logging.getLogger(__name__)


class OutOfStep(TransferError):
    """The request cannot be skipped cleanly: reply with the error, then close the connection."""


class Broken(TransferError):
    """The reply is already under way (payload half sent): close the connection without a reply."""


@dataclass
class PeerContext:
    sock: socket.socket
    pid: int | None  # kernel-verified for Unix-socket peers, None over TCP


Handler = Callable[[PeerContext, dict[str, Any]], None]


def _listen_unix(name: str) -> socket.socket | None:
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + name)
        sock.listen(128)
    except OSError as exc:
        log.info("same-host socket unavailable (%s); peers will use TCP", exc)
        return None
    return sock


def _peer_pid(sock: socket.socket) -> int | None:
    if sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


class ControlServer:
    def __init__(self, config: TransferConfig, handlers: dict[str, Handler], uds_name: str) -> None:
        self.config = config
        self.handlers = handlers
        listeners = [socket.create_server((config.host, config.port))]
        self.port = listeners[0].getsockname()[1]
        unix = _listen_unix(uds_name)
        self.uds_name = uds_name if unix is not None else None
        self._listener = ThreadedListener(listeners + ([unix] if unix else []), self._serve, "pdserve-te")

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(self.config.connect_timeout_s)
            tune(sock, self.config.socket_buffer_bytes)
            wire.server_handshake(sock, self.config.secret)
            sock.settimeout(None)
            ctx = PeerContext(sock, _peer_pid(sock))
            while not self._listener.closed:
                self._serve_one(ctx)
        except (OSError, TransferError) as exc:
            log.debug("engine connection closed: %s", exc)

    def _serve_one(self, ctx: PeerContext) -> None:
        try:
            msg = wire.recv_msg(ctx.sock)
            handler = self.handlers.get(msg["t"])
            if handler is None:
                raise OutOfStep("protocol", f"unknown request type {msg['t']!r}")
            handler(ctx, msg)
        except TransferError as exc:
            if isinstance(exc, Broken):
                raise
            wire.send_msg(ctx.sock, {"t": "err", "code": exc.code, "m": exc.message})
            if isinstance(exc, OutOfStep) or exc.code == "protocol":
                raise

    def close(self) -> None:
        self._listener.close()
