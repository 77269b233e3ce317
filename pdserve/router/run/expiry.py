"""A request's deadline as one loop timer (``--request-timeout-s``): the part of
:class:`~pdserve.router.run.generation.Generation` that sets it and turns its expiry into the 504 (or an error
event)."""

from __future__ import annotations

import asyncio
import time

from ..errors import RouterError, deadline_exceeded
from ..metrics import RouterMetrics
from .timings import Timings


class RequestDeadline:
    """Mixed into Generation, which sets these attributes in its ``__init__``."""

    request_timeout_s: float | None
    t: Timings
    metrics: RouterMetrics
    _deadline: float | None  # loop time by which the request must end
    _waiter: asyncio.Task | None  # the task awaiting a worker delta, if any
    _expired: bool  # the deadline passed
    _cancelled: bool  # _expire (or a move) cancelled _waiter, not yet turned into the 504 (or the move)

    def _deadline_at(self) -> float | None:
        if self.request_timeout_s is None:
            return None
        if self._deadline is None:
            loop = asyncio.get_running_loop()
            self._deadline = loop.time() - (time.perf_counter() - self.t.arrive) + self.request_timeout_s
        return self._deadline

    def _expire(self) -> None:
        """The request's deadline passed (one timer per request, not one per awaited token): cancel the await on
        the worker stream if one is in progress, else the next one fails at once."""
        self._expired = True
        if self._waiter is not None:
            self._cancelled = True
            self._waiter.cancel()

    def _own_cancel(self, task: asyncio.Task | None) -> bool:
        """On a CancelledError while ``task`` awaited the worker: True when this request cancelled it (its deadline's
        ``_expire``, or a move) and nothing else did (not also the client or the server); the flag is cleared."""
        if self._cancelled and task is not None:
            self._cancelled = False
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+; 3.10 cannot tell, takes it as ours
            return uncancel is None or uncancel() == 0
        return False

    def _deadline_error(self) -> RouterError:
        self.metrics.deadlines.labels("request").inc()
        return deadline_exceeded(f"the request did not finish within its deadline of {self.request_timeout_s:g}"
                                 " s (router --request-timeout-s)", "request_timeout")
