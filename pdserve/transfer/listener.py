"""Threaded socket servers: listen, accept, one thread per connection, and one shutdown.

Both the transfer engine's control server and the KV pool's RPC server are built on this: they only say
what to do with one accepted connection. ``close`` stops accepting, then shuts every live connection
down so that threads blocked in ``recv`` return at once; each connection thread closes its own socket.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)
ConnectionHandler = Callable[[socket.socket], None]


class ThreadedListener:
    """Accept on every socket in ``listeners`` and run ``handle(sock)`` on its own daemon thread.

    ``handle`` owns the work on one connection; the socket is closed (and forgotten) when it returns or
    raises. ``closed`` tells handlers in a request loop to stop.
    """

    def __init__(self, listeners: Iterable[socket.socket], handle: ConnectionHandler, name: str) -> None:
        self._listeners = list(listeners)
        self._handle = handle
        self.name = name
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        for listener in self._listeners:
            threading.Thread(target=self._accept_loop, args=(listener,), name=f"{name}-accept",
                             daemon=True).start()

    @property
    def closed(self) -> bool:
        return self._closed

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(sock)
            threading.Thread(target=self._run, args=(sock,), name=f"{self.name}-conn", daemon=True).start()

    def _run(self, sock: socket.socket) -> None:
        try:
            self._handle(sock)
        except Exception:  # a bug must not take the process (or other connections) down
            log.exception("%s: connection handler crashed; closing that connection", self.name)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def close(self) -> None:
        """Stop accepting and interrupt every open connection (idempotent)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept (Linux)
            except OSError:
                pass
            listener.close()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
