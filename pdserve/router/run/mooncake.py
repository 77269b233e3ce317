"""Where each prefill worker's Mooncake bootstrap server is, and which engine id it answers (``--kv-connector
mooncake``).

vLLM's MooncakeConnector (``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/``) hands KV over like this: P's
worker registers its transfer-engine address with a bootstrap server that P's own rank 0 runs on its host
(``MooncakeBootstrapServer``, port ``VLLM_MOONCAKE_BOOTSTRAP_PORT``; ``GET /query`` answers
``{dp_rank: {"engine_id": ..., "worker_addr": {tp_rank: {pp_rank: addr}}}}``). P answers no
``kv_transfer_params`` of its own, so whoever hands the request to D must name P's bootstrap address and engine
id itself. The engine id is random per vLLM start, so it is asked of the bootstrap server, not configured, and
kept only :data:`ENGINE_ID_TTL_S`: a restarted P answers a new id, and D pulls from the address its id names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import aiohttp

log = logging.getLogger("pdserve.router")

ENGINE_ID_TTL_S = 2.0  # how long a P's engine id is trusted before the bootstrap server is asked again
QUERY_TIMEOUT_S = 2.0  # one GET /query on P's bootstrap server


class BootstrapBook:
    """P's bootstrap address (its host, the port listed for it or ``default_port``) and its engine id (asked,
    cached :data:`ENGINE_ID_TTL_S`)."""

    def __init__(self, default_port: int, ports: Mapping[str, int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.default_port = default_port
        self.ports = dict(ports or {})
        self.clock = clock
        self._engines: dict[str, tuple[str, float]] = {}  # bootstrap address -> (engine id, when asked)
        self._asking: dict[str, asyncio.Task[str | None]] = {}

    def address(self, prefill_url: str) -> str:
        """``http://HOST:PORT`` of the bootstrap server of the worker at ``prefill_url``."""
        url = prefill_url.rstrip("/")
        host = urlsplit(url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.ports.get(url, self.default_port)}"

    async def engine_id(self, prefill_url: str) -> str | None:
        """P's engine id as its bootstrap server answers it (data-parallel rank 0); None when the server does not
        answer one (P down, or not a MooncakeConnector worker). Concurrent callers share one query."""
        addr = self.address(prefill_url)
        known = self._engines.get(addr)
        if known is not None and self.clock() - known[1] < ENGINE_ID_TTL_S:
            return known[0]
        task = self._asking.get(addr)
        if task is None:  # one query per address at a time; a caller that goes away does not cancel it
            task = self._asking[addr] = asyncio.ensure_future(query_engine_id(addr))
            task.add_done_callback(lambda t: self._asked(addr, t))
        return await asyncio.shield(task)

    def _asked(self, addr: str, task: asyncio.Task[str | None]) -> None:
        self._asking.pop(addr, None)
        found = None if task.cancelled() or task.exception() is not None else task.result()
        if found is None:
            self._engines.pop(addr, None)
        else:
            self._engines[addr] = (found, self.clock())


async def query_engine_id(address: str) -> str | None:
    """``GET address/query`` -> the engine id of data-parallel rank 0 (the one P the router calls); None when the
    server is unreachable or answers something else."""
    try:
        timeout = aiohttp.ClientTimeout(total=QUERY_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{address}/query") as resp:
                if resp.status != 200:
                    log.warning("mooncake bootstrap %s/query answered HTTP %d", address, resp.status)
                    return None
                data = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        log.warning("mooncake bootstrap %s/query failed: %s", address, e)
        return None
    entry = data.get("0") if isinstance(data, dict) else None
    engine = entry.get("engine_id") if isinstance(entry, dict) else None
    return engine if isinstance(engine, str) and engine else None
