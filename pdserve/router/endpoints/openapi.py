"""GET /openapi.json: what the router accepts, stated once at start-up (:mod:`..api.openapi`)."""

from __future__ import annotations

from aiohttp import web

from ..api.openapi import openapi_document
from .context import RouterContext

OPENAPI_KEY: web.AppKey[dict] = web.AppKey("openapi")  # the document, for tests that read it


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    c = ctx.config
    document = openapi_document(c.served_model_name, c.max_model_len, c.max_body_bytes, ctx.tokenizer.vocab_size,
                                bool(c.tool_call_parser))

    app[OPENAPI_KEY] = document

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(request.app[OPENAPI_KEY])

    app.router.add_get("/openapi.json", openapi)
