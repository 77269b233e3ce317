"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: change the served adapters on every worker, all or none.

A load goes to every registered worker at once. If any fails, the ones that loaded it unload it again, the router
does not list it, and the answer names each worker that failed (a 4xx every worker agrees on is passed through as
vLLM wrote it, e.g. a bad path; otherwise 502). An unload takes the adapter off the list whatever the workers say
(a request for it would fail on a worker that lacks it) and names the workers that failed. Served only with
``--enable-lora``, as vLLM serves them only with runtime LoRA updates allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from ..api.limits import read_body
from ..api.model_catalog import ModelCatalog
from ..api.protocol import parse_json
from ..errors import RouterError, bad_request, not_found
from ..workers.broadcast import LOAD_PATH, UNLOAD_PATH, WorkerAnswer, post_all
from .context import RouterContext


def failure(action: str, name: str, failed: list[WorkerAnswer], of: int, note: str = "") -> RouterError:
    """The error for a load or unload some workers refused: their 4xx when every failed worker answered the same
    4xx (vLLM's own message), else 502; the message names each failed worker."""
    statuses = {a.status for a in failed}
    only = next(iter(statuses)) if len(statuses) == 1 else 0
    status = only if 400 <= only < 500 else 502
    message = (f"{action} of LoRA adapter '{name}' failed on {len(failed)} of {of} worker(s): "
               + "; ".join(a.describe() for a in failed) + note)
    return RouterError(status, message, "invalid_request_error" if status < 500 else "server_error",
                       "lora_name", "lora_adapter_failed")


def _name(body: Any, with_path: bool) -> tuple[str, str]:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise bad_request("'lora_name' is required: a non-empty string", "lora_name")
    if with_path and (not isinstance(path, str) or not path):
        raise bad_request("'lora_path' is required: a non-empty string", "lora_path")
    return name, path if isinstance(path, str) else ""


class LoraAdmin:
    """The two endpoints. ``workers``: every registered worker's URL now; ``session``: the router's HTTP session."""

    def __init__(self, catalog: ModelCatalog, workers: Callable[[], list[str]],
                 session: Callable[[], aiohttp.ClientSession | None], max_body_bytes: int,
                 timeout_s: float = 120.0) -> None:
        self.catalog = catalog
        self.workers = workers
        self.session = session
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s

    async def _body(self, request: web.Request) -> Any:
        if not self.catalog.lora:
            raise not_found("LoRA is off on this router's workers: start pdserve serve with --lora-modules or "
                            "--enable-lora", None, "lora_disabled")
        return parse_json(await read_body(request, self.max_body_bytes))

    def _targets(self) -> tuple[aiohttp.ClientSession, list[str]]:
        session, urls = self.session(), self.workers()
        if session is None or not urls:
            raise RouterError(503, "no worker to load the adapter on", "service_unavailable", None,
                              "no_healthy_worker")
        return session, urls

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name, path = _name(body, True)
        c = self.catalog
        async with c.lock:
            if name == c.base or (name in c.adapters and not body.get("load_inplace")):
                raise bad_request(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                  "adapter in place, set 'load_inplace' to True.", "lora_name")
            session, urls = self._targets()
            answers = await post_all(session, urls, LOAD_PATH, body, self.timeout_s)
            failed = [a for a in answers if not a.ok]
            if not failed:
                c.add(name, path)
                return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
            loaded = [a.url for a in answers if a.ok]
            note = ""
            if loaded and name not in c.adapters:  # take it off the workers that loaded it: all or none
                undone = await post_all(session, loaded, UNLOAD_PATH, {"lora_name": name}, self.timeout_s)
                left = [a.url for a in undone if not a.ok]
                note = f"; unloaded again from {len(loaded) - len(left)} worker(s)" + (
                    f", still loaded on {', '.join(left)}" if left else "")
            raise failure("load", name, failed, len(answers), note)

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name, _ = _name(body, False)
        c = self.catalog
        async with c.lock:
            session, urls = self._targets()
            answers = await post_all(session, urls, UNLOAD_PATH, body, self.timeout_s)
            known = c.remove(name)
            if all(a.status == 404 for a in answers) and not known:
                raise not_found(f"The lora adapter '{name}' cannot be found.", "lora_name")
            failed = [a for a in answers if not a.ok and a.status != 404]  # 404: that worker has it no more
            if not failed:
                return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
            raise failure("unload", name, failed, len(answers), " (the router no longer lists it)" if known else "")


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    if not ctx.config.enable_lora:
        return
    admin = LoraAdmin(ctx.models, lambda: [w.url for w in ctx.registry], ctx.workers.get_session,
                      ctx.config.max_body_bytes)
    app.router.add_post(LOAD_PATH, admin.load)
    app.router.add_post(UNLOAD_PATH, admin.unload)
