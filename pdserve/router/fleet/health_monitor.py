"""Every worker's health, probed every ``--health-interval-s`` (and on each GET /health): its /health answer, and,
with LoRA adapters listed, whether it has them (:mod:`.adapter_sync` loads what it lacks first). The registry hears
each result (:meth:`.registry.WorkerRegistry.report_probe`: a slow answer alone does not take a worker out)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..metrics import RouterMetrics
from ..workers.session import WorkerSession
from .adapter_sync import AdapterSync
from .registry import WorkerRegistry

log = logging.getLogger("pdserve.router")


class HealthMonitor:
    def __init__(self, registry: WorkerRegistry, workers: WorkerSession, adapter_sync: AdapterSync,
                 metrics: RouterMetrics, timeout_s: float, interval_s: float) -> None:
        self.registry = registry
        self.workers = workers
        self.adapter_sync = adapter_sync
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.served: set[str] = set()  # workers a probe has found healthy: one taken out after that and back returned

    async def run(self) -> None:
        """Probe every ``interval_s`` until cancelled; a failed round is logged, never the end of the loop."""
        while True:
            try:
                await self.probe()
            except Exception:
                log.exception("health probe failed")
            await asyncio.sleep(self.interval_s)

    async def probe(self) -> list[dict[str, Any]]:
        """One round over every registered worker; what GET /health lists of each."""
        client = self.workers.started()
        workers = list(self.registry)
        results = await asyncio.gather(*(client.check(w.url, self.timeout_s) for w in workers))
        lacking = await asyncio.gather(*(self.adapter_sync.ensure(w.url) if p.ok else _none()
                                         for w, p in zip(workers, results)))
        out = []
        for w, probe, why in zip(workers, results, lacking):
            was = w.healthy
            if why is not None:  # it answers, but lacks adapters the router lists
                self.registry.set_health(w.url, False, why)
            else:
                self.registry.report_probe(w.url, probe)
            if w.healthy and not was and w.url in self.served:  # back after being out: a restart, as seen here
                self.metrics.worker_returns.labels(w.url).inc()
            if w.healthy:
                self.served.add(w.url)
            for role in sorted(w.roles):
                self.metrics.worker_healthy.labels(role, w.url).set(1.0 if w.healthy else 0.0)
            out.append({"url": w.url, "roles": sorted(w.roles), "healthy": probe.ok and why is None,
                        "detail": why or probe.detail, "serving": w.healthy})
        return out


async def _none() -> None:
    return None
