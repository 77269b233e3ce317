"""Client side of engine connections: authenticated sockets, pooled per peer address."""

from __future__ import annotations

import socket
import threading
from typing import Any

from . import wire
from .config import TransferConfig
from .errors import TransferError

Address = tuple[str, int] | str  # (host, port) over TCP, or an abstract Unix socket name


def _connect(address: Address, timeout: float) -> socket.socket:
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + address)
        except OSError:
            sock.close()
            raise
        return sock
    return socket.create_connection(address, timeout=timeout)


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)


class Connection:
    """One authenticated connection to a peer engine, used by one stream at a time."""

    def __init__(self, address: Address, config: TransferConfig, timeout: float | None = None) -> None:
        """Connect and authenticate within ``timeout`` seconds (at most the config's ``connect_timeout_s``)."""
        self.address = address
        self.max_iov = config.max_iov
        wait = config.connect_timeout_s if timeout is None else max(1e-3, min(timeout, config.connect_timeout_s))
        # out of the caller's time (a batch's deadline) rather than the peer's connect budget: "deadline"
        late = "deadline" if wait < config.connect_timeout_s else "peer"
        try:
            self.sock = _connect(address, wait)
        except OSError as exc:
            code = late if isinstance(exc, TimeoutError) else "peer"
            raise TransferError(code, f"cannot connect to engine at {address}: {exc}") from exc
        try:
            tune(self.sock, config.socket_buffer_bytes)
            wire.client_handshake(self.sock, config.secret)
        except (OSError, TransferError) as exc:
            self.close()
            if isinstance(exc, TransferError):
                raise
            code = late if isinstance(exc, TimeoutError) else "peer"
            raise TransferError(code, f"handshake with {address} failed: {exc}") from exc

    def call(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one header-only request and return the (non-error) reply."""
        self.sock.settimeout(timeout)
        wire.send_msg(self.sock, msg)
        return wire.raise_if_error(wire.recv_msg(self.sock))

    def interrupt(self) -> None:
        """Unblock any thread waiting on this socket (used on abort and deadline)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class PeerPool:
    """Idle connections to one peer; new ones are opened on demand up to ``limit`` in use."""

    def __init__(self, address: Address, config: TransferConfig, limit: int) -> None:
        self.address = address
        self.config = config
        self._idle: list[Connection] = []
        self._in_use = 0
        self._limit = limit
        self._cond = threading.Condition()

    def acquire(self, timeout: float) -> Connection:
        with self._cond:
            if not self._cond.wait_for(lambda: self._idle or self._in_use < self._limit, timeout):
                raise TransferError("deadline", f"no free connection to {self.address} in time")
            self._in_use += 1
            if self._idle:
                return self._idle.pop()
        try:
            return Connection(self.address, self.config, timeout)
        except BaseException:
            with self._cond:
                self._in_use -= 1
                self._cond.notify()
            raise

    def release(self, conn: Connection, healthy: bool) -> None:
        with self._cond:
            self._in_use -= 1
            if healthy:
                self._idle.append(conn)
            self._cond.notify()
        if not healthy:
            conn.close()

    def call(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One header-only request on a pooled connection; the connection goes back only if it worked."""
        conn = self.acquire(timeout)
        ok = False
        try:
            reply = conn.call(msg, timeout)
            ok = True
            return reply
        except OSError as exc:
            raise TransferError("peer", f"engine at {self.address} did not answer: {exc}") from exc
        finally:
            self.release(conn, ok)

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
