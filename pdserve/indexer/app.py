"""The indexer's HTTP API: Mooncake's KV indexer API where it defines one (``/register``, ``/unregister``,
``/query``, ``/query_by_hash``), plus ``/global_view``, ``/expect`` (placeholders) and ``/snapshot``.

Differences from Mooncake's (docs/indexer.md): ``instance_id`` is the worker's URL, which is also the topic its
vLLM publishes under (the feed keys a stream by its topic); ``seq_hashes`` are pdserve's chained block keys
(:mod:`pdserve.hashing`, what the router and the pool use), or, with ``"hash": "xxh3"`` and ``--xxh3``, Mooncake's
XXH3 rolling sequence hashes (:mod:`.xxh3_keys`); a lookup answers in
tokens per pdserve tier (``device``, ``host``, ``disk``, ``pool_memory``, ``pool_disk``, ``store``,
``placeholder``) and ``longest_matched``; one model per indexer (``model`` and ``tenant_id`` are echoed, not
used to scope). Errors are OpenAI-style JSON (``{"error": {"message", "type", "code"}}``) with status 400 or 404.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..hashing import block_hashes, domain_root
from ..router.fleet.kv_events import Publisher
from . import snapshot
from .service import IndexerService
from .table import LONGEST

SERVICE: web.AppKey[IndexerService] = web.AppKey("indexer", IndexerService)
TENANT = "default"


class BadRequest(Exception):
    pass


def _error(status: int, message: str, code: str = "invalid_request") -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                             status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except Exception:
        raise BadRequest("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _str(body: dict[str, Any], name: str, required: bool = True) -> str:
    v = body.get(name)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or (required and not v):
        raise BadRequest(f"'{name}' must be a non-empty string")
    return v


def _ints(body: dict[str, Any], name: str, limit: int = 1 << 64) -> list[int]:
    v = body.get(name)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < limit
                                          for x in v):
        raise BadRequest(f"'{name}' must be a list of non-negative integers below {limit}")
    return v


def _block_size(svc: IndexerService, body: dict[str, Any]) -> None:
    bs = body.get("block_size", svc.config.block_size)
    if bs != svc.config.block_size:
        raise BadRequest(f"block_size {bs!r}: this indexer keys {svc.config.block_size}-token blocks")


def _keys_of(svc: IndexerService, body: dict[str, Any]) -> list[int]:
    """The request's block keys: ``seq_hashes`` (or Mooncake's older ``block_hash``) as given (``"hash": "xxh3"``:
    Mooncake's XXH3 sequence hashes, translated to the keys learned for them), else computed from ``token_ids``;
    both in the request's key domain (``cache_salt``, ``lora_name``)."""
    _block_size(svc, body)
    algo = body.get("hash", "pdserve")
    if algo not in ("pdserve", "xxh3"):
        raise BadRequest(f"hash {algo!r}: use 'pdserve' (pdserve's chained block keys) or 'xxh3' (Mooncake's "
                         "rolling sequence hashes; docs/indexer.md)")
    root = domain_root(_str(body, "cache_salt", False) or None, _str(body, "lora_name", False) or None)
    for name in ("seq_hashes", "block_hash"):
        if name in body:
            given = _ints(body, name)
            if algo == "pdserve":
                return given
            if svc.xxh3 is None:
                raise BadRequest("hash 'xxh3': this indexer keeps no XXH3 map; start it with --xxh3")
            return svc.xxh3.keys(given, root)
    tokens = _ints(body, "token_ids", 1 << 32)
    return block_hashes(tokens, svc.config.block_size, root)


def _answer(svc: IndexerService, body: dict[str, Any], keys: list[int]) -> dict[str, Any]:
    owner = _str(body, "instance_id", False)
    medium = body.get("medium")
    if medium is not None and (not isinstance(medium, list) or not all(isinstance(m, str) for m in medium)):
        raise BadRequest("'medium' must be a list of tier names")
    found = svc.table.lookup(keys, [owner.rstrip("/")] if owner else None, medium)
    bs = svc.config.block_size
    per = {o: {"longest_matched": t.pop(LONGEST) * bs, **{tier: n * bs for tier, n in t.items()}}
           for o, t in found.items()}
    return {_str(body, "tenant_id", False) or TENANT: per}


async def query(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request)
    if "token_ids" not in body:
        raise BadRequest("'token_ids' is required (or POST /query_by_hash with 'seq_hashes')")
    return web.json_response(_answer(svc, body, _keys_of(svc, body)))


async def query_by_hash(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request)
    if "seq_hashes" not in body and "block_hash" not in body:
        raise BadRequest("'seq_hashes' is required")
    return web.json_response(_answer(svc, body, _keys_of(svc, body)))


async def register(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request)
    worker = _str(body, "instance_id")
    endpoint = _str(body, "endpoint")
    replay = _str(body, "replay_endpoint", False)
    if not endpoint.startswith(("tcp://", "ipc://")) or (replay and not replay.startswith(("tcp://", "ipc://"))):
        raise BadRequest("'endpoint' and 'replay_endpoint' must be tcp:// or ipc:// ZMQ endpoints")
    _block_size(svc, body)
    svc.register(worker, Publisher(endpoint, replay))
    return web.json_response({"status": "registered successfully", "instance_id": worker})


async def unregister(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    body = await _body(request)
    worker = _str(body, "instance_id")
    if not svc.unregister(worker):
        return _error(404, f"instance {worker!r} is not registered", "not_found")
    return web.json_response({"status": "unregistered successfully", "removed_instances": [worker]})


async def expect(request: web.Request) -> web.Response:
    """A placement just sent this prompt to ``instance_id``: placeholders for its blocks (bounded life)."""
    svc = request.app[SERVICE]
    body = await _body(request)
    worker = _str(body, "instance_id").rstrip("/")
    keys = _keys_of(svc, body)
    n = svc.table.expect(worker, keys)
    svc.expects.add(worker, keys, _str(body, "origin", False))
    return web.json_response({"instance_id": worker, "placeholders": n, "ttl_s": svc.config.placeholder_ttl_s})


async def expect_log(request: web.Request) -> web.Response:
    """The placeholders posted from ``since`` on (``-1``: those still alive): each router replica reads the
    others' placements this way (pdserve/router/fleet/placeholders.py)."""
    svc = request.app[SERVICE]
    raw = request.query.get("since", "-1")
    try:
        since = int(raw)
    except ValueError:
        raise BadRequest(f"since={raw!r}: give the 'next' of the last answer, or -1") from None
    return web.json_response({"entries": svc.expects.since(since), "next": svc.expects.next,
                              "ttl_s": svc.config.placeholder_ttl_s})


async def global_view(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    return web.json_response({"block_size": svc.config.block_size, "blocks": svc.table.blocks(),
                              "indexed_keys": len(svc.table.index), "streams": svc.streams(),
                              "counters": svc.counters(), "snapshot": vars(svc.stats)})


async def take_snapshot(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    if not svc.config.snapshot_path:
        return _error(400, "this indexer has no --indexer-snapshot path")
    return web.json_response(vars(await svc.snapshot_now()))


async def snapshot_now(request: web.Request) -> web.Response:
    """The table as of now, in the snapshot file's format (msgpack): a router seeds its index from it."""
    svc = request.app[SERVICE]
    return web.Response(body=snapshot.encode(svc.capture()), content_type="application/msgpack")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e))
    except web.HTTPException as e:  # unknown path, wrong method: JSON too
        if e.status < 400:
            raise
        return _error(e.status, e.reason, "not_found" if e.status == 404 else "invalid_request")


def create_app(service: IndexerService) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=64 << 20)
    app[SERVICE] = service
    app.router.add_post("/register", register)
    app.router.add_post("/unregister", unregister)
    app.router.add_post("/query", query)
    app.router.add_post("/query_by_hash", query_by_hash)
    app.router.add_post("/expect", expect)
    app.router.add_get("/expect", expect_log)
    app.router.add_get("/global_view", global_view)
    app.router.add_post("/snapshot", take_snapshot)
    app.router.add_get("/snapshot", snapshot_now)
    app.router.add_get("/health", health)

    async def on_startup(app: web.Application) -> None:
        await service.start()

    async def on_cleanup(app: web.Application) -> None:
        await service.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
