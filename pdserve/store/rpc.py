"""msgpack request/reply over TCP for the pool's control plane (master <-> nodes <-> clients).

Framing and authentication are the transfer engine's (:mod:`pdserve.transfer.wire`): a 4-byte length, a
msgpack map, and the same HMAC challenge-response on every connection with the deployment's shared secret.
A call is ``{"t": "call", "m": method, "a": {...}}``; the reply ``{"t": "ok", "r": result}`` or
``{"t": "err", "code": ..., "m": ...}``. Bulk KV bytes never travel here: they move through the transfer
engine straight between registered memory.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from pdserve.transfer import wire
from pdserve.transfer.errors import TransferError
from pdserve.transfer.listener import ThreadedListener

log = logging.getLogger(__name__)
Handler = Callable[[dict[str, Any]], Any]


class StoreError(Exception):
    """A pool call failed; ``code`` is short and machine-readable (``unavailable``, ``protocol``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class RpcServer:
    """Threaded server: one thread per authenticated connection, handlers called with the args map."""

    def __init__(self, host: str, port: int, secret: str, handlers: dict[str, Handler], name: str) -> None:
        self.secret = secret
        self.handlers = handlers
        self.name = name
        sock = socket.create_server((host, port), reuse_port=False)
        self.host = host
        self.port = sock.getsockname()[1]
        self._listener = ThreadedListener([sock], self._serve, name)

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(10.0)
            wire.server_handshake(sock, self.secret)
            sock.settimeout(None)
            while not self._listener.closed:
                msg = wire.recv_msg(sock)
                wire.send_msg(sock, self._dispatch(msg))
        except (OSError, TransferError) as exc:
            log.debug("%s: connection closed: %s", self.name, exc)

    def _dispatch(self, msg: dict[str, Any]) -> dict[str, Any]:
        method = msg.get("m")
        handler = self.handlers.get(method) if isinstance(method, str) else None
        if msg.get("t") != "call" or handler is None:
            return {"t": "err", "code": "protocol", "m": f"unknown call {method!r}; this is {self.name}"}
        args = msg.get("a") or {}
        try:
            return {"t": "ok", "r": handler(args)}
        except StoreError as exc:
            return {"t": "err", "code": exc.code, "m": exc.message}
        except (KeyError, TypeError, ValueError) as exc:
            return {"t": "err", "code": "bad_request", "m": f"{method}: {type(exc).__name__}: {exc}"}
        except Exception as exc:
            log.exception("%s: %s failed", self.name, method)
            return {"t": "err", "code": "internal", "m": f"{method}: {type(exc).__name__}: {exc}"}

    def close(self) -> None:
        self._listener.close()


class RpcClient:
    """Calls to one server over a small pool of connections; thread-safe. A broken connection is dropped and
    the call retried once on a fresh one (calls are idempotent or carry their own guard)."""

    def __init__(self, host: str, port: int, secret: str, timeout_s: float = 5.0, max_idle: int = 4) -> None:
        self.address = (host, port)
        self.secret = secret
        self.timeout_s = timeout_s
        self.max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as exc:
            raise StoreError("unavailable", f"cannot reach {self.address[0]}:{self.address[1]}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.client_handshake(sock, self.secret)
        except (OSError, TransferError) as exc:
            sock.close()
            code = exc.code if isinstance(exc, TransferError) else "unavailable"
            raise StoreError(code, f"handshake with {self.address[0]}:{self.address[1]} failed: {exc}") from None
        return sock

    def call(self, method: str, timeout_s: float | None = None, **args: Any) -> Any:
        for attempt in (0, 1):
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            fresh = sock is None
            if sock is None:
                sock = self._connect()
            try:
                sock.settimeout(timeout_s or self.timeout_s)
                wire.send_msg(sock, {"t": "call", "m": method, "a": args})
                reply = wire.recv_msg(sock)
            except (OSError, TransferError) as exc:
                sock.close()
                if fresh or attempt:
                    raise StoreError("unavailable", f"{method} to {self.address[0]}:{self.address[1]}: "
                                                    f"{type(exc).__name__}: {exc}") from None
                continue  # a pooled connection went stale (server restarted): retry once on a new one
            with self._lock:
                if len(self._idle) < self.max_idle:
                    self._idle.append(sock)
                    sock = None
            if sock is not None:
                sock.close()
            if reply.get("t") == "err":
                raise StoreError(str(reply.get("code", "remote")), str(reply.get("m", "remote error")))
            return reply.get("r")
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
