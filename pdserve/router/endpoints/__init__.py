"""The router's endpoints: one module per endpoint (or per small family of them), each with
``add_routes(app, ctx)`` taking what it needs from :class:`.context.RouterContext`. :func:`add_routes` adds every
module's, so a new endpoint is one new module here (plus its test). Every generation endpoint goes through the one
front door, :mod:`.intake`."""

from __future__ import annotations

import importlib
import pkgutil

from aiohttp import web

from .context import RouterContext


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    """Every endpoint module's routes, in the modules' name order."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        add = getattr(module, "add_routes", None)
        if add is not None:
            add(app, ctx)
