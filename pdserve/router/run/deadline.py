"""Awaiting something by a deadline (event-loop time): the request's and the P -> D hand-off's.

On expiry the awaited work is cancelled where it stands (inside a worker stream that closes its connection, so vLLM
aborts the request and frees its KV) and ``asyncio.TimeoutError`` is raised.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):
    async def within(aw: Awaitable[T], when: float) -> T:
        """``await aw``, or asyncio.TimeoutError once the loop's clock passes ``when``."""
        async with asyncio.timeout_at(when):
            return await aw
else:  # pragma: no cover - Python 3.10
    async def within(aw: Awaitable[T], when: float) -> T:
        """``await aw``, or asyncio.TimeoutError once the loop's clock passes ``when``."""
        return await asyncio.wait_for(aw, max(0.0, when - asyncio.get_running_loop().time()))
