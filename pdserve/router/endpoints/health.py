"""GET /health, /ready and /metrics: the router's own state for the launcher, Kubernetes and Prometheus."""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web

from ...http_probe import PID_HEADER
from .context import RouterContext


class HealthEndpoints:
    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx

    async def health(self, request: web.Request) -> web.Response:
        """200 only when every configured worker answers its /health (probed now); names the replica's pid."""
        workers = await self.ctx.health.probe()
        ok = all(w["healthy"] for w in workers)
        return web.json_response({"status": "ok" if ok else "unhealthy", "mode": self.ctx.config.mode,
                                  "workers": workers}, status=200 if ok else 503,
                                 headers={PID_HEADER: str(os.getpid())})  # which replica answered

    async def ready(self, request: web.Request) -> web.Response:
        """200 while some healthy worker can serve a request end to end (from the last probes): "ready" with a
        healthy worker of each role, "degraded" with one role gone (P decodes locally, or D prefills locally;
        ``missing`` names the role), 503 "not ready" with none. Unlike /health, a dead worker of several does not
        make the router unready."""
        mode, registry = self.ctx.config.mode, self.ctx.registry
        healthy = registry.healthy()
        need = (("colocated",),) if mode == "colocated" else (("prefill",), ("decode",))
        missing = [r[0] for r in need if not any(set(r) & w.roles for w in healthy)]
        serving = bool(healthy) and len(missing) < len(need)
        status = "ready" if not missing else "degraded" if serving else "not ready"
        body: dict[str, Any] = {"status": status, "mode": mode, "healthy_workers": len(healthy),
                                "workers": len(registry)}
        if missing:
            body["missing"] = missing
        return web.json_response(body, status=200 if serving else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.ctx.metrics.render()
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    h = HealthEndpoints(ctx)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ready", h.ready)
    app.router.add_get("/metrics", h.metrics)
