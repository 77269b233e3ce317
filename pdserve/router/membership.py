"""Worker membership at run time: ``/v1/pdserve/workers``.

GET lists workers with health and the conductor's load view; POST ``{"url", "role"}`` adds a
worker (or a role to it); DELETE ``{"url"}`` (or ``?url=``) removes one: it gets no new requests from that
moment, its in-flight requests finish. Used by the Kubernetes discovery sidecar and by drain hooks.
Guarded: a bearer token (``RouterConfig.admin_token`` / $PDSERVE_ADMIN_TOKEN) or, when none is set, clients on
this host only.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .config import RouterConfigError, _check_url
from .errors import RouterError, bad_request, not_found
from .workers import Worker

if TYPE_CHECKING:
    from .app import Router

PATH = "/v1/pdserve/workers"


def _authorize(router: "Router", request: web.Request) -> None:
    token = router.config.admin_token
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
        body = json.loads(raw)
    except ValueError:
        raise bad_request("body must be JSON like {\"url\": \"http://10.0.0.5:8000\", \"role\": \"decode\"}") from None
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    return body


def _listing(router: "Router") -> dict[str, Any]:
    cp = router.conducted
    snap = {s["worker"]: s for s in cp.conductor.snapshot()} if cp is not None else {}
    workers = []
    for w in router.workers.values():
        item: dict[str, Any] = {"url": w.url, "roles": sorted(w.roles), "healthy": w.healthy,
                                "last_error": w.last_error or None}
        item.update({k: v for k, v in snap.get(w.url, {}).items() if k not in ("worker", "role", "healthy")})
        workers.append(item)
    out: dict[str, Any] = {"policy": router.config.policy, "mode": router.config.mode, "workers": workers}
    if cp is not None:
        describe = getattr(cp.conductor.cost, "describe", None)
        if describe is not None:
            out["cost_model"] = describe()
        out["decisions"] = dict(cp.conductor.counts)
        out["indexed_blocks"] = len(cp.conductor.index)
    if router.calibration is not None:
        out["calibration"] = router.calibration
    return out


def add_routes(app: web.Application, router: "Router") -> None:
    async def list_workers(request: web.Request) -> web.Response:
        _authorize(router, request)
        return web.json_response(_listing(router))

    async def add_worker(request: web.Request) -> web.Response:
        _authorize(router, request)
        body = await _body(request)
        role = body.get("role")
        allowed = ("colocated",) if router.config.mode == "colocated" else ("prefill", "decode")
        if role not in allowed:
            raise bad_request(f"role must be one of {', '.join(allowed)} (this router is {router.config.mode})",
                              "role")
        try:
            url = _check_url("url", str(body.get("url") or ""))
        except RouterConfigError as e:
            raise bad_request(str(e), "url") from None
        cp = router.conducted
        w = router.workers.get(url) or Worker(url)
        w.roles.add(role)
        w.healthy, w.last_error = True, ""
        if cp is not None:
            cp.add(w)
        else:
            router.workers[url] = w
        return web.json_response({"added": url, "roles": sorted(w.roles)}, status=201)

    async def remove_worker(request: web.Request) -> web.Response:
        _authorize(router, request)
        body = await _body(request)
        url = str(body.get("url") or "").rstrip("/")
        if url not in router.workers:
            raise not_found(f"no worker {url!r} is registered (GET {PATH} lists them)", "url")
        cp = router.conducted
        if cp is not None:
            cp.remove(url)
        else:
            router.workers.pop(url, None)
        router.forget_events(url)
        return web.json_response({"removed": url})

    app.router.add_get(PATH, list_workers)
    app.router.add_post(PATH, add_worker)
    app.router.add_delete(PATH, remove_worker)
