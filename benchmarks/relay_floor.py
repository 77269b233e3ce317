"""The floor of a Python router's cost per streamed token: a bare CPython asyncio TCP relay in front of a worker
(``benchmarks/router_overhead_bench.py --floor`` runs it in the same rotation as the router and the worker).

    python benchmarks/relay_floor.py PORT WORKER_HOST WORKER_PORT    # what start_floor runs
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bare_relay(port: int, host: str, worker_port: int) -> int:
    """A TCP relay in CPython asyncio, the lower bound of any Python router on this loop: every client connection
    gets its own connection to the worker, and bytes go either way as they come (``asyncio.Protocol``, one
    ``transport.write`` per ``data_received``; no HTTP parsing, no rewriting, no coroutine per token)."""

    class Up(asyncio.Protocol):
        def __init__(self, down: Down) -> None:
            self.down = down

        def data_received(self, data: bytes) -> None:
            self.down.transport.write(data)

        def connection_lost(self, exc: BaseException | None) -> None:
            self.down.transport.close()

    class Down(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport
            self.up: asyncio.Transport | None = None
            transport.pause_reading()
            self.task = asyncio.ensure_future(self._connect())

        async def _connect(self) -> None:
            up, _ = await asyncio.get_running_loop().create_connection(lambda: Up(self), host, worker_port)
            self.up = up
            self.transport.resume_reading()

        def data_received(self, data: bytes) -> None:
            assert self.up is not None
            self.up.write(data)

        def connection_lost(self, exc: BaseException | None) -> None:
            if self.up is not None:
                self.up.close()

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Down, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(serve())
    return 0


def start_floor(worker_url: str, out_dir: Path) -> tuple[subprocess.Popen, str]:
    """The bare relay (:func:`bare_relay`) in front of the worker at ``worker_url``; returns (process, url) once
    a /health through it answers 200."""
    import urllib.parse

    from pdserve.launch.procs import free_port, spawn_healthy

    port = free_port()
    w = urllib.parse.urlsplit(worker_url)
    argv = [sys.executable, str(Path(__file__).resolve()), str(port), w.hostname or "127.0.0.1", str(w.port)]
    child = spawn_healthy("bare-relay", argv, f"http://127.0.0.1:{port}", 60, log_path=out_dir / "bare-relay.log")
    return child.proc, child.url


if __name__ == "__main__":
    sys.exit(bare_relay(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
