"""The router's OpenAPI 3.1 document (served at ``GET /openapi.json``): its paths, responses and error shapes, with
the request schemas of :mod:`.openapi_requests` and :mod:`.openapi_agents`.

The request schemas state what the router accepts: the fields it parses with the ranges it enforces, null where it
reads null as "not sent", the rules between fields (JSON Schema conditions where JSON Schema can state them, the
``x-pdserve-rules`` of :mod:`.openapi_rules` where it cannot), so a fuzzer that follows the document sends requests
the router accepts, and one that breaks it gets a 4xx with the :data:`ERROR` body.
"""

from __future__ import annotations

from typing import Any

from .openapi_agents import messages_schema, responses_schema
from .openapi_parts import STR, TOKEN_IDS, nullable, ref
from .openapi_requests import TOKENIZE, chat_schema, completion_schema

ANTHROPIC_ERROR: dict[str, Any] = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": STR, "message": STR}}}}

ERROR: dict[str, Any] = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": STR, "type": STR, "param": nullable(STR),
        # the router's own codes are names; a worker's refusal keeps vLLM's code, its HTTP status
        "code": {"type": ["string", "integer", "null"]}}}}}

_ANY_OBJECT = {"type": "object", "additionalProperties": True}
_SSE_EVENT = {"type": "object", "properties": {"data": STR, "event": STR}}  # one server-sent event


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int, schema: str = "Error") -> dict[str, Any]:
    text = {400: "invalid request", 403: "not allowed from this client", 404: "unknown model or worker",
            413: "body over --max-body-bytes", 422: "refused by the worker (vLLM's 422)",
            429: "predicted to miss the SLO", 502: "a worker failed",
            503: "no healthy worker", 504: "the request's deadline passed"}
    return {str(s): {"description": text[s], "content": _json(ref(schema))} for s in statuses}


_DECISION_HEADER = {"name": "X-Pdserve-Decision", "in": "header", "required": False, "schema": STR,
                    "description": "1 or true: the answer's X-Pdserve-Decision header carries the request's decision "
                                   "record (compact JSON; a stream's: the placement in force when it opens)"}


def _generation(summary: str, schema: str, error: str = "Error") -> dict[str, Any]:
    return {"post": {"summary": summary, "operationId": schema[0].lower() + schema[1:-len("Request")],
                     "requestBody": {"required": True, "content": _json(ref(schema))},
                     "parameters": [_DECISION_HEADER],
                     "responses": {"200": {"description": "the completion (JSON), or server-sent events with "
                                                          "stream: true",
                                           "content": {**_json(_ANY_OBJECT),
                                                       "text/event-stream": {"schema": _SSE_EVENT}}},
                                   **_errors(400, 404, 413, 422, 429, 502, 503, 504, schema=error)}}}


def _get(summary: str, op: str, content_type: str = "application/json", *statuses: int) -> dict[str, Any]:
    schema = _ANY_OBJECT if content_type == "application/json" else STR
    responses: dict[str, Any] = {"200": {"description": "OK", "content": {content_type: {"schema": schema}}}}
    for s in statuses:
        responses[str(s)] = {"description": "not healthy / not ready", "content": _json(_ANY_OBJECT)}
    return {"get": {"summary": summary, "operationId": op, "responses": responses}}


def _post(summary: str, op: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"summary": summary, "operationId": op,
                     "requestBody": {"required": True, "content": _json(schema)},
                     "responses": {"200": {"description": "OK", "content": _json(_ANY_OBJECT)},
                                   **_errors(400, 404, 413)}}}


_WORKER_BODY = {"type": "object", "required": ["url"], "properties": {
    "url": {"type": "string", "description": "worker base URL, e.g. http://10.0.0.5:8000"},
    "role": {"type": "string", "enum": ["prefill", "decode", "colocated"]}}}


def _workers() -> dict[str, Any]:
    body = {"required": False, "content": _json(ref("WorkerChange"))}
    admin: list[dict[str, list[str]]] = [{}, {"adminToken": []}]
    return {
        "get": {"summary": "list workers, health and placement state", "operationId": "listWorkers",
                "security": admin, "responses": {"200": {"description": "OK", "content": _json(_ANY_OBJECT)},
                                                 **_errors(403)}},
        "post": {"summary": "add a worker", "operationId": "addWorker", "security": admin, "requestBody": body,
                 "responses": {"201": {"description": "added", "content": _json(_ANY_OBJECT)},
                               **_errors(400, 403, 413)}},
        "delete": {"summary": "remove a worker", "operationId": "removeWorker", "security": admin,
                   "requestBody": body, "responses": {"200": {"description": "removed", "content": _json(_ANY_OBJECT)},
                                                      **_errors(400, 403, 404, 413)}},
    }


def _decision() -> dict[str, Any]:
    param = {"name": "request_id", "in": "path", "required": True, "schema": STR,
             "description": "the answer's X-Request-Id (its id when the client set no request_id)"}
    return {"get": {"summary": "the request's decision record: candidates, the chosen pair and rule, predicted and "
                               "measured TTFT/TPOT, migrations, moves, rejection", "operationId": "getDecision",
                    "parameters": [param],
                    "responses": {"200": {"description": "OK", "content": _json(_ANY_OBJECT)}, **_errors(404)}}}


def _named(schema: dict[str, Any], model: str) -> dict[str, Any]:
    """A request schema whose ``model`` shows the served name as its example (a fuzzer then reaches past the 404)."""
    props = schema["properties"]
    return {**schema, "properties": {**props, "model": {**props["model"], "examples": [model]}}}


def openapi_document(model: str, max_model_len: int, max_body_bytes: int, vocab_size: int,
                     tool_parser: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 description of this router's endpoints (its limits in the info text; ``vocab_size``: the
    tokenizer's, which bounds every token id; ``tool_parser``: whether it runs --tool-call-parser, which any
    tool_choice but none needs)."""
    requests = {"CompletionRequest": completion_schema(max_model_len, vocab_size),
                "ChatCompletionRequest": chat_schema(max_model_len, vocab_size, tool_parser),
                "MessagesRequest": messages_schema(max_model_len, tool_parser),
                "ResponsesRequest": responses_schema(max_model_len, tool_parser)}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve router", "version": "1",
                 "description": f"OpenAI-compatible API serving `{model}` (context {max_model_len} tokens; request "
                                f"bodies up to {max_body_bytes} bytes). Errors use the OpenAI error object."},
        "paths": {
            "/v1/completions": _generation("text completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("chat completion", "ChatCompletionRequest"),
            "/v1/messages": _generation("Anthropic Messages API (stateless; errors in Anthropic's shape)",
                                        "MessagesRequest", "AnthropicError"),
            "/v1/responses": _generation("OpenAI Responses API (stateless)", "ResponsesRequest"),
            "/v1/models": _get("the served model", "listModels"),
            "/health": _get("200 when every worker answers its /health", "health", "application/json", 503),
            "/ready": _get("200 when a healthy worker of each needed role is known", "ready", "application/json",
                           503),
            "/metrics": _get("Prometheus metrics", "metrics", "text/plain"),
            "/v1/pdserve/workers": _workers(),
            "/v1/pdserve/decisions/{request_id}": _decision(),
            "/v1/pdserve/fleet": _get("the live view's JSON: workers, roles, health, queues, KV use, prediction "
                                      "error, restarts seen, the last minute's placements, the newest decision "
                                      "records", "getFleet"),
            "/dashboard": _get("the live view of the fleet (an HTML page polling /v1/pdserve/fleet)", "dashboard",
                               "text/html"),
            "/openapi.json": _get("this document", "openapi"),
            "/tokenize": _post("token ids of a prompt or a chat (as vLLM's /tokenize)", "tokenize", TOKENIZE),
            "/detokenize": _post("text of token ids (as vLLM's /detokenize)", "detokenize", {
                "type": "object", "required": ["tokens"], "properties": {"tokens": TOKEN_IDS}}),
        },
        "components": {
            "schemas": {
                **{name: _named(schema, model) for name, schema in requests.items()},
                "AnthropicError": ANTHROPIC_ERROR,
                "WorkerChange": _WORKER_BODY,
                "Error": ERROR,
                "TokenId": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1,
                            "description": "a token id of the served model's vocabulary"},
                "TruncatePromptTokens": {"type": "integer", "minimum": -1, "maximum": max_model_len,
                                         "not": {"const": 0}, "description": "-1: the context less one; 0 is "
                                         "refused (the prompt would be empty), as vLLM refuses it"},
            },
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer",
                                               "description": "$PDSERVE_ADMIN_TOKEN; without one, loopback only"}},
        },
    }
