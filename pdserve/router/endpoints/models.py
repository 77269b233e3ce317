"""GET /v1/models: the served model and its LoRA adapters (:class:`..api.model_catalog.ModelCatalog`)."""

from __future__ import annotations

from aiohttp import web

from .context import RouterContext


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    async def list_models(request: web.Request) -> web.Response:
        return web.json_response(ctx.models.listing())

    app.router.add_get("/v1/models", list_models)
