"""One POST to every worker at once (the LoRA adapter loads and unloads), one answer each, never an exception."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

LOAD_PATH = "/v1/load_lora_adapter"  # vLLM's runtime LoRA endpoints (the router serves the same two paths)
UNLOAD_PATH = "/v1/unload_lora_adapter"


@dataclass
class WorkerAnswer:
    url: str
    status: int  # 0: no answer (connection refused, timeout)
    text: str

    @property
    def ok(self) -> bool:
        return self.status == 200

    def payload(self) -> Any:
        try:
            return json.loads(self.text)
        except ValueError:
            return None

    def describe(self) -> str:
        body = self.payload()
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        return f"{self.url}: " + (f"HTTP {self.status}: {message or self.text[:200]}" if self.status
                                  else self.text)


async def post_all(session: aiohttp.ClientSession, urls: Iterable[str], path: str, body: dict[str, Any],
                   timeout_s: float) -> list[WorkerAnswer]:
    """POST ``body`` to ``path`` of every worker at once; one answer each, never an exception."""
    async def one(url: str) -> WorkerAnswer:
        try:
            async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return WorkerAnswer(url, r.status, await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return WorkerAnswer(url, 0, f"no answer: {type(e).__name__} {e}".strip())
    return list(await asyncio.gather(*(one(u) for u in urls)))
