"""The router's bound on requests in flight, all workers together: past it a request is answered 429 with
Retry-After before its body is read, so a flood costs the router a few kilobytes per request it turns away.
(Per worker, the conductor skips workers at ``max_inflight_per_worker`` and rejects when all are: every policy.)
"""

from __future__ import annotations

from .errors import too_many_requests
from .metrics import RouterMetrics


class Admission:
    """Counts requests from admission to their answer; ``limit`` None admits everything."""

    def __init__(self, limit: int | None, metrics: RouterMetrics | None = None) -> None:
        self.limit = limit
        self.metrics = metrics
        self.inflight = 0

    def enter(self) -> bool:
        """Admit one request (True; call :meth:`leave` once when it ends) or raise a 429 RouterError."""
        if self.limit is not None and self.inflight >= self.limit:
            if self.metrics is not None:
                self.metrics.rejected.labels("max_inflight").inc()
            raise too_many_requests(f"Server is busy: {self.inflight} requests in flight, the router's limit "
                                    f"(--max-inflight {self.limit}). Retry after 1 s.", 1.0, "max_inflight")
        self.inflight += 1
        return True

    def leave(self) -> None:
        self.inflight = max(0, self.inflight - 1)
