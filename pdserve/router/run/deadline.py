"""Deadlines (event-loop time): the request's (:class:`Deadline`, ``--request-timeout-s``) and the P -> D
hand-off's (:func:`within`).

On expiry the awaited work is cancelled where it stands (inside a worker stream that closes its connection, so vLLM
aborts the request and frees its KV), and the client gets a 504 (or an error event after the first token).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..errors import RouterError, deadline_exceeded
from ..metrics import RouterMetrics

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


class Deadline:
    """One request's deadline as one loop timer (not one per awaited token), armed when its run starts: at expiry
    ``on_expiry`` interrupts the run's await on a worker, and every later one fails at once (:attr:`expired`)."""

    __slots__ = ("timeout_s", "arrive", "metrics", "on_expiry", "expired", "_timer")

    def __init__(self, timeout_s: float | None, arrive: float, metrics: RouterMetrics,
                 on_expiry: Callable[[], object]) -> None:
        self.timeout_s = timeout_s
        self.arrive = arrive  # perf_counter of the request's arrival: the deadline counts from there
        self.metrics = metrics
        self.on_expiry = on_expiry
        self.expired = False
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Start the timer (once; nothing without a timeout)."""
        if self._timer is not None or self.timeout_s is None:
            return
        loop = asyncio.get_running_loop()
        at = loop.time() - (time.perf_counter() - self.arrive) + self.timeout_s
        self._timer = loop.call_at(at, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.on_expiry()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def error(self) -> RouterError:
        """The 504 (counted once per call)."""
        self.metrics.deadlines.labels("request").inc()
        return deadline_exceeded(f"the request did not finish within its deadline of {self.timeout_s:g} s (router "
                                 "--request-timeout-s)", "request_timeout")
