"""A worker's LoRA adapters brought to the router's list before it takes requests.

A worker restarted by the supervisor (or a pod that starts later) loads only its configured ``--lora-modules``;
the adapters loaded at run time through ``/v1/load_lora_adapter`` are gone from it while the router still lists
them. So each health probe that finds a worker answering also asks its ``/v1/models`` (vLLM lists its loaded
adapters there) whether it has every adapter the catalog lists; it loads the missing ones (the path the catalog
keeps, one ``/v1/load_lora_adapter`` each) and lists again. Until the worker lists them all it counts as unhealthy
(:meth:`AdapterSync.ensure` says why), so no request for any adapter reaches it without the adapter. The check
costs one ``GET /v1/models`` per worker per probe, only with LoRA on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp

from ..api.model_catalog import ModelCatalog
from ..workers.broadcast import LOAD_PATH, post_all


class AdapterSync:
    """Re-applies the catalog's adapters to a worker that lacks them. ``session``: the router's HTTP session;
    ``list_timeout_s``: how long a worker's /v1/models may take (it runs inside the health probe: the router's
    ``health_timeout_s``); ``timeout_s``: how long loading an adapter may take."""

    def __init__(self, catalog: ModelCatalog, session: Callable[[], aiohttp.ClientSession | None],
                 list_timeout_s: float, timeout_s: float = 120.0) -> None:
        self.catalog = catalog
        self.session = session
        self.list_timeout_s = list_timeout_s
        self.timeout_s = timeout_s
        self.reloads = 0  # adapters loaded again onto workers that came back without them

    async def listed(self, url: str) -> set[str] | None:
        """The model names the worker's /v1/models lists (None: no usable answer)."""
        session = self.session()
        if session is None:
            return None
        try:
            async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=self.list_timeout_s)) as r:
                if r.status != 200:
                    return None
                data = json.loads(await r.text()).get("data")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None
        return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)} \
            if isinstance(data, list) else None

    async def ensure(self, url: str) -> str | None:
        """Load onto ``url`` the listed adapters it lacks; None when it has them all (or LoRA is off), else why
        not."""
        if not self.catalog.lora or not self.catalog.adapters:
            return None
        have = await self.listed(url)
        if have is None:
            return "its /v1/models did not answer: its LoRA adapters are unknown"
        if not set(self.catalog.adapters) - have:
            return None
        session = self.session()
        if session is None or self.catalog.lock.locked():  # a load or unload is on its way (to this worker too)
            return "LoRA adapters being changed: checked again at the next probe"
        async with self.catalog.lock:  # no load or unload through the router meanwhile
            missing = {n: p for n, p in self.catalog.adapters.items() if n not in have}
            answers = await asyncio.gather(*(post_all(session, [url], LOAD_PATH, {"lora_name": n, "lora_path": p},
                                                      self.timeout_s) for n, p in missing.items()))
        have = await self.listed(url) or set()
        left = sorted(set(missing) - have)
        self.reloads += len(missing) - len(left)
        if not left:
            return None
        why = "; ".join(a.describe() for group in answers for a in group if not a.ok)
        return f"LoRA adapter(s) {', '.join(left)} not loaded again" + (f": {why}" if why else "")
