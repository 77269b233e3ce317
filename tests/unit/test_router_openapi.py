"""GET /openapi.json: a valid OpenAPI 3.1 document whose paths and methods are exactly the app's routes, and whose
request schemas accept the requests the router serves and describe its error body."""

from __future__ import annotations

import json

import pytest

from pdserve.router.api.openapi import openapi_document
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def validator(doc: dict, name: str):
    """A validator of the document's component ``name``, its ``$ref``s resolved in the document."""
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator({"$ref": "#/components/schemas/" + name, "components": doc["components"]})


def _app_routes(app) -> dict[str, set[str]]:
    routes: dict[str, set[str]] = {}
    for route in app.router.routes():
        if route.method == "HEAD":  # aiohttp adds HEAD to every GET route
            continue
        routes.setdefault(route.resource.canonical, set()).add(route.method.lower())
    return routes


def _fetch(model_dir, tokenizer) -> tuple[dict, dict[str, set[str]]]:
    out: dict = {}

    async def main():
        async with Env(model_dir, tokenizer, colocated=[FakeWorker("W")], max_body_bytes=1 << 20) as env:
            async with env.session.get(env.url + "/openapi.json") as r:
                assert r.status == 200 and r.content_type == "application/json"
                out["doc"] = json.loads(await r.read())
            out["routes"] = _app_routes(env.app)
    run(main())
    return out["doc"], out["routes"]


def test_openapi_served_and_matches_routes(model_dir, tokenizer):
    doc, routes = _fetch(model_dir, tokenizer)
    assert doc["openapi"].startswith("3.1")
    assert str(1 << 20) in doc["info"]["description"] and "tiny" in doc["info"]["description"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics",
                 "/v1/pdserve/workers", "/openapi.json"):
        assert path in routes, path
    assert set(doc["paths"]) == set(routes)
    for path, item in doc["paths"].items():
        assert {m for m in item if m in _METHODS} == routes[path], path
    assert routes["/v1/pdserve/workers"] == {"get", "post", "delete"}
    ops = [op["operationId"] for item in doc["paths"].values() for m, op in item.items() if m in _METHODS]
    assert len(ops) == len(set(ops)), "operationIds must be unique"


def test_openapi_document_is_valid(model_dir, tokenizer):
    validate = pytest.importorskip("openapi_spec_validator").validate
    doc, _ = _fetch(model_dir, tokenizer)
    validate(doc)  # raises on any structural error (OpenAPI 3.1 meta-schema and references)


def test_structure_by_hand(model_dir):
    doc = openapi_document("m", 128, 4 << 20, 1000)
    schemas = doc["components"]["schemas"]
    refs = []

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(doc)
    assert refs and all(r.startswith("#/components/schemas/") and r.rsplit("/", 1)[1] in schemas for r in refs)
    for path in ("/v1/completions", "/v1/chat/completions"):
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["required"] is True
        for status in ("400", "413"):
            assert post["responses"][status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/Error"}
    assert schemas["Error"]["properties"]["error"]["required"] == ["message", "type", "param", "code"]


def test_request_schemas_accept_served_requests_and_error_body():
    doc = openapi_document("m", 128, 4 << 20, 1000)
    chat, comp, err = (validator(doc, name) for name in ("ChatCompletionRequest", "CompletionRequest", "Error"))
    chat.validate({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                   "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}, "stop": ["x"],
                   "temperature": 0.5, "top_p": 1, "seed": 3})
    comp.validate({"prompt": [1, 2, 3], "max_tokens": None, "ignore_eos": True})
    comp.validate({"prompt": ["one"]})
    assert not chat.is_valid({"messages": []}) and not chat.is_valid({"messages": [{"content": "no role"}]})
    assert not chat.is_valid({"messages": [{"role": "user", "content": "x"}], "n": 0})
    assert not chat.is_valid({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})
    assert not comp.is_valid({"prompt": ""}) and not comp.is_valid({}) and not comp.is_valid({"prompt": [-1]})
    assert not comp.is_valid({"prompt": "x", "top_p": 0})
    assert not comp.is_valid({"prompt": [1000]}) and comp.is_valid({"prompt": [999]})  # the vocabulary's ids
    assert comp.is_valid({"prompt": "x", "stream": "yes", "stream_options": {"include_usage": 1}})  # lax booleans
    assert not comp.is_valid({"prompt": "x", "stream": "no", "stream_options": {"include_usage": True}})
    assert comp.is_valid({"prompt": "x", "n": None}) is False and comp.is_valid({"prompt": "x", "seed": None})
    assert not chat.is_valid({"messages": [{"role": "u"}], "stop": ""})  # vLLM refuses an empty stop string
    err.validate({"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}})
    assert not err.is_valid({"message": "m"})


def test_document_lists_every_route_of_a_disaggregated_app(model_dir, tokenizer):
    config = RouterConfig(model_dir=str(model_dir), prefill=("http://127.0.0.1:9",), decode=("http://127.0.0.1:10",),
                          health_interval_s=0)
    app = create_app(config, tokenizer=tokenizer)
    from pdserve.router.endpoints.openapi import OPENAPI_KEY

    routes = _app_routes(app)
    paths = app[OPENAPI_KEY]["paths"]
    assert set(paths) == set(routes)
    assert all({m for m in paths[p] if m in _METHODS} == routes[p] for p in routes)
