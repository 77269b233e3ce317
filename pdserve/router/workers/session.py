"""The router's one HTTP session to its workers and the :class:`~.client.WorkerClient` over it: opened when the app
starts, closed when it stops. Whatever talks to a worker (a request's run, the health probes, the LoRA calls, the
calibration) reads them from here, so nothing else owns the session's lifecycle."""

from __future__ import annotations

import aiohttp

from . import reader_tap
from .client import WorkerClient


class WorkerSession:
    """``session`` and ``client`` are None before :meth:`open` and after :meth:`close`."""

    def __init__(self, connect_timeout_s: float, idle_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.client: WorkerClient | None = None

    def open(self) -> None:
        """Open the session (inside the event loop); decides once whether the relay's inline tap is used."""
        reader_tap.check()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.client = WorkerClient(self.session, self.connect_timeout_s, self.idle_timeout_s)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def get_session(self) -> aiohttp.ClientSession | None:
        """The session, for callers that take it as a callable (None before the app starts)."""
        return self.session

    def started(self) -> WorkerClient:
        """The client; the app must have started."""
        assert self.client is not None, "router not started"
        return self.client
