"""Worker membership at run time: ``/v1/pdserve/workers``.

GET lists workers with health and the conductor's load view (and which router replica answered: ``replica``);
POST ``{"url", "role"}`` adds a worker (or a role to it; role ``elastic`` in an elastic router, ``colocated`` in
a colocated one, else ``prefill`` or ``decode``), with ``"kv_events"`` (and ``"kv_replay"``): the ZMQ endpoints
where its vLLM publishes KV events (the conductor subscribes); DELETE ``{"url"}`` (or ``?url=``) removes one: it
gets no new requests from that moment, its in-flight requests finish. With a shared membership file every router
replica of the host follows the change (:mod:`..fleet.shared_membership`). Used by the Kubernetes discovery sidecar
and by drain hooks.
Guarded: a bearer token (``RouterConfig.admin_token`` / $PDSERVE_ADMIN_TOKEN) or, when none is set, clients on
this host only.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..api.limits import load_json
from ..config import RouterConfig, RouterConfigError, check_endpoint, check_url
from ..errors import RouterError, bad_request, not_found
from ..fleet.kv_events import Publisher
from ..fleet.placement import Placement
from ..fleet.registry import WorkerRegistry
from .context import RouterContext

PATH = "/v1/pdserve/workers"


def _authorize(config: RouterConfig, request: web.Request) -> None:
    token = config.admin_token
    if token:
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise RouterError(401, "worker membership needs 'Authorization: Bearer <admin token>' "
                                   "($PDSERVE_ADMIN_TOKEN of the router)", "authentication_error")
        return
    try:
        loopback = ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise RouterError(403, "worker membership is only open to this host; start the router with "
                               "$PDSERVE_ADMIN_TOKEN set to manage it remotely", "permission_error")


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        return dict(request.query)
    try:
        body = load_json(raw)
    except RouterError:
        raise bad_request("body must be JSON like {\"url\": \"http://10.0.0.5:8000\", \"role\": \"decode\"}") from None
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    return body


def _check_role(config: RouterConfig, role: Any) -> str:
    """``role`` when this router's mode takes it (colocated; prefill or decode; elastic), else a 400."""
    if config.is_elastic:
        if role != "elastic":
            raise bad_request(f"role {role!r}: this router is elastic (started with --elastic or --mode elastic): its "
                              "workers have no fixed role, register them with role elastic", "role")
        return role
    allowed = ("colocated",) if config.mode == "colocated" else ("prefill", "decode")
    if role == "elastic":
        raise bad_request(f"role 'elastic' needs a router started in elastic mode (--elastic URL... or --mode "
                          f"elastic); this router is {config.mode}: use role {' or '.join(allowed)}", "role")
    if not isinstance(role, str) or role not in allowed:
        raise bad_request(f"role must be one of {', '.join(allowed)} (this router is {config.mode})", "role")
    return role


def _publisher(body: dict[str, Any]) -> Publisher | None:
    """The worker's KV event publisher from ``kv_events`` / ``kv_replay`` (None when not given)."""
    if not body.get("kv_events"):
        return None
    try:
        endpoint = check_endpoint("kv_events", str(body["kv_events"]))
        replay = check_endpoint("kv_replay", str(body["kv_replay"])) if body.get("kv_replay") else ""
    except RouterConfigError as e:
        raise bad_request(str(e), "kv_events") from None
    return Publisher(endpoint, replay)


class Membership:
    """The membership API over the app's registry; the conductor follows the registry by itself."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, placement: Placement,
                 calibration: Callable[[], dict | None] = lambda: None,
                 publishers: dict[str, Publisher] | None = None,
                 changed: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.publishers = publishers if publishers is not None else {}  # shared with the app's KV event feed
        self.changed = changed  # tells the other router replicas (the shared membership file)
        self.registry = registry
        self.placement = placement
        self.calibration = calibration

    def listing(self) -> dict[str, Any]:
        conductor = getattr(self.placement, "conductor", None)
        snap = {s["worker"]: s for s in conductor.snapshot()} if conductor is not None else {}
        workers = []
        for w in self.registry:
            item: dict[str, Any] = {"url": w.url, "roles": sorted(w.roles), "healthy": w.healthy,
                                    "last_error": w.last_error or None}
            item.update({k: v for k, v in snap.get(w.url, {}).items() if k not in ("worker", "role", "healthy")})
            workers.append(item)
        out: dict[str, Any] = {"policy": self.config.policy, "mode": self.config.mode, "workers": workers,
                               "elastic": self.config.is_elastic,
                               "replica": {"pid": os.getpid(), "routers": self.config.routers}}
        if conductor is not None:
            describe = getattr(conductor.cost, "describe", None)
            if describe is not None:
                out["cost_model"] = describe()
            out["decisions"] = dict(conductor.counts)
            if self.config.is_elastic:
                out["placements"] = dict(conductor.placements)  # colocated / chunked / split
            out["indexed_blocks"] = len(conductor.index)
        calibration = self.calibration()
        if calibration is not None:
            out["calibration"] = calibration
        return out

    async def list_workers(self, request: web.Request) -> web.Response:
        _authorize(self.config, request)
        return web.json_response(self.listing())

    async def add_worker(self, request: web.Request) -> web.Response:
        _authorize(self.config, request)
        body = await _body(request)
        role = _check_role(self.config, body.get("role"))
        try:
            url = check_url("url", str(body.get("url") or ""))
        except RouterConfigError as e:
            raise bad_request(str(e), "url") from None
        publisher = _publisher(body)
        if publisher is not None:
            self.publishers[url] = publisher
        w = self.registry.add(url, role)
        if self.changed is not None:
            self.changed(url)
        return web.json_response({"added": url, "roles": sorted(w.roles)}, status=201)

    async def remove_worker(self, request: web.Request) -> web.Response:
        _authorize(self.config, request)
        body = await _body(request)
        url = str(body.get("url") or "").rstrip("/")
        self.publishers.pop(url, None)
        if self.registry.remove(url) is None:
            raise not_found(f"no worker {url!r} is registered (GET {PATH} lists them)", "url")
        if self.changed is not None:
            self.changed(url)
        return web.json_response({"removed": url})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.list_workers)
        app.router.add_post(PATH, self.add_worker)
        app.router.add_delete(PATH, self.remove_worker)


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    changed = ctx.shared.changed if ctx.shared is not None else None
    Membership(ctx.config, ctx.registry, ctx.placement, lambda: ctx.calibration.result, ctx.kv.publishers,
               changed).add_routes(app)
