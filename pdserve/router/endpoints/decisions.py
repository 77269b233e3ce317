"""The request's decision record (:mod:`..fleet.decision_log`) on request: each placement's candidates as the
conductor chose them, the rule, the predicted and measured TTFT and TPOT, moves and migrations, or the rejection.

- ``GET /v1/pdserve/decisions/{request_id}``: ``request_id`` is the answer's ``X-Request-Id`` header. 404 once the
  bounded ring no longer holds it (or the placement has not closed yet).
- ``X-Pdserve-Decision: 1`` on a generation request: its answer carries the record in the ``X-Pdserve-Decision``
  header (compact JSON). A JSON answer's placements are all closed; a stream's headers go out with its first
  chunk, so its record holds the placement in force then (``"open": true``, nothing measured yet) after any that
  closed before; the GET above has the whole record once the request ends. Past :data:`HEADER_MAX` characters the
  candidates are left out (``"truncated": true``).
"""

from __future__ import annotations

from aiohttp import web

from ..errors import not_found
from .context import RouterContext
from .decision_header import CHOICES_KEY, DECISION_HEADER, header_value


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    log = getattr(ctx.placement, "decisions", None)

    async def decision(request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        record = log.get(rid) if log is not None else None
        if record is None:  # the app's middleware answers it as OpenAI's error object
            raise not_found(f"no decision record for request {rid!r} (the router keeps the newest "
                            f"{log.capacity if log is not None else 0} requests' records, each once its placement "
                            f"has ended)", "request_id", "decision_not_found")
        return web.json_response(record)

    async def attach(request: web.Request, response: web.StreamResponse) -> None:
        asked = request.get(CHOICES_KEY)  # (the request id, its choices): Intake.start keeps them when asked
        if asked is not None and asked[1]:
            response.headers[DECISION_HEADER] = header_value(log, asked[1], asked[0])

    app.router.add_get("/v1/pdserve/decisions/{request_id}", decision)
    app.on_response_prepare.append(attach)
