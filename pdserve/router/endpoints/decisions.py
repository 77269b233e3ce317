"""``GET /v1/pdserve/decisions/{request_id}``: the request's decision record (:mod:`..fleet.decision_log`): each
placement's candidates as the conductor chose them, the rule, the predicted and measured TTFT and TPOT, moves and
migrations, or the rejection. ``request_id`` is the answer's ``X-Request-Id`` header. 404 once the bounded ring no
longer holds it (or the placement has not closed yet)."""

from __future__ import annotations

from aiohttp import web

from ..errors import not_found
from .context import RouterContext


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    async def decision(request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        log = getattr(ctx.placement, "decisions", None)
        record = log.get(rid) if log is not None else None
        if record is None:  # the app's middleware answers it as OpenAI's error object
            raise not_found(f"no decision record for request {rid!r} (the router keeps the newest "
                            f"{log.capacity if log is not None else 0} requests' records, each once its placement "
                            f"has ended)", "request_id", "decision_not_found")
        return web.json_response(record)

    app.router.add_get("/v1/pdserve/decisions/{request_id}", decision)
