"""The served model and its LoRA adapters: which names ``model`` may take, GET /v1/models, and
POST /v1/load_lora_adapter / /v1/unload_lora_adapter, which reach every worker.

:class:`ModelCatalog` is the one owner of the adapter list. It starts from the configured ``--lora-modules`` (what
every worker loads at start, and again after a restart) and follows the load and unload calls made through this
router and, with ``--routers N``, through the other replicas of the host (the ``lora_adapters`` section of their
shared file: :mod:`..fleet.shared_adapters`). It is kept here rather than asked of a worker per request: the
model check runs on every request with no worker round trip, and it cannot disagree between P and D. A worker
that comes back (restarted, with only the configured adapters) gets the others loaded again before it takes
requests (:mod:`..fleet.adapter_sync`). A request with ``model=<adapter>`` is sent to P and D
with that model (both run the adapter), its block keys take the adapter into their domain
(:func:`pdserve.hashing.domain_root`), and the answer's ``model`` is the adapter's name, as vLLM's is.

A load goes to every registered worker at once. If any fails, the ones that loaded it unload it again, the router
does not list it, and the answer names each worker that failed (a 4xx every worker agrees on is passed through as
vLLM wrote it, e.g. a bad path; otherwise 502). An unload takes the adapter off the list whatever the workers say
(a request for it would fail on a worker that lacks it) and names the workers that failed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from ..errors import RouterError, bad_request, not_found
from .limits import read_body
from .protocol import parse_json

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class ModelCatalog:
    """The base model's name and the adapters (name -> path) that ``model`` may name."""

    def __init__(self, base: str, root: str, max_model_len: int, created: int,
                 adapters: Mapping[str, str] | None = None, lora: bool = False) -> None:
        self.base = base
        self.root = root
        self.max_model_len = max_model_len
        self.created = created
        self.adapters: dict[str, str] = dict(adapters or {})
        self.lora = lora or bool(self.adapters)
        self.lock = asyncio.Lock()  # one load or unload (or a worker's re-load) at a time
        self.changed: Callable[[str, str | None], None] | None = None  # told each add / remove (the shared file)

    def add(self, name: str, path: str) -> None:
        """List an adapter every worker has loaded."""
        self.adapters[name] = path
        if self.changed is not None:
            self.changed(name, path)

    def remove(self, name: str) -> bool:
        """Stop listing an adapter; False when it was not listed."""
        known = self.adapters.pop(name, None) is not None
        if known and self.changed is not None:
            self.changed(name, None)
        return known

    def replace(self, adapters: Mapping[str, str]) -> None:
        """Take another replica's list (the shared file), without telling it back."""
        self.adapters = dict(adapters)

    def adapter(self, model: Any) -> str | None:
        """The adapter ``model`` names (None: the base model, or no model given); 404 ``model_not_found`` for any
        other name, as the router answered before adapters."""
        if model is None or model == self.base:
            return None
        if isinstance(model, str) and model in self.adapters:
            return model
        raise not_found(f"The model `{model}` does not exist. This router serves `{self.base}`"
                        + (f" and the adapters {', '.join(sorted(self.adapters))}" if self.adapters else "")
                        + " (see /v1/models).", "model", "model_not_found")

    def refuse_prompt_scoring(self, prompt_logprobs: int | None, echo: bool, logprobs: int | None) -> None:
        """With LoRA on, a request that scores its prompt (``prompt_logprobs``, or ``echo`` with ``logprobs``) is a
        400: vLLM 0.32's engine core dies computing prompt logprobs through LoRA's logits processor when the request
        shares a step with another (``einsum(): subscript b has size 2 ... does not broadcast``), taking every
        request on that worker with it. A refusal costs the client a feature; the crash costs everyone a worker."""
        if self.lora and (prompt_logprobs is not None or (echo and logprobs is not None)):
            raise bad_request("prompt_logprobs (and echo with logprobs) are not served while the workers run LoRA "
                              "adapters: vLLM 0.32 crashes the worker computing prompt logprobs with LoRA on",
                              "prompt_logprobs")

    def answer_name(self, lora: str | None) -> str:
        """The ``model`` of the answer to a request that ran adapter ``lora`` (None: the base model): the adapter's
        name, else the served model's, as vLLM names its answers."""
        return lora or self.base

    def listing(self) -> dict[str, Any]:
        """GET /v1/models as vLLM answers it: the base model, then each adapter (root = its path, parent = the
        base model)."""
        data = [{"id": self.base, "object": "model", "created": self.created, "owned_by": "pdserve",
                 "root": self.root, "parent": None, "max_model_len": self.max_model_len}]
        data += [{"id": name, "object": "model", "created": self.created, "owned_by": "pdserve", "root": path,
                  "parent": self.base, "max_model_len": None} for name, path in self.adapters.items()]
        return {"object": "list", "data": data}


@dataclass
class WorkerAnswer:
    url: str
    status: int  # 0: no answer (connection refused, timeout)
    text: str

    @property
    def ok(self) -> bool:
        return self.status == 200

    def payload(self) -> Any:
        try:
            return json.loads(self.text)
        except ValueError:
            return None

    def describe(self) -> str:
        body = self.payload()
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        return f"{self.url}: " + (f"HTTP {self.status}: {message or self.text[:200]}" if self.status
                                  else self.text)


async def post_all(session: aiohttp.ClientSession, urls: Iterable[str], path: str, body: dict[str, Any],
                   timeout_s: float) -> list[WorkerAnswer]:
    """POST ``body`` to ``path`` of every worker at once; one answer each, never an exception."""
    async def one(url: str) -> WorkerAnswer:
        try:
            async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return WorkerAnswer(url, r.status, await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return WorkerAnswer(url, 0, f"no answer: {type(e).__name__} {e}".strip())
    return list(await asyncio.gather(*(one(u) for u in urls)))


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


def add_routes(app: web.Application, admin: LoraAdmin) -> None:
    app.router.add_post(LOAD_PATH, admin.load)
    app.router.add_post(UNLOAD_PATH, admin.unload)
