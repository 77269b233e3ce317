"""The router's OpenAPI 3.1 document (served at ``GET /openapi.json``), built from the tables below.

The request schemas list the fields :mod:`.protocol` parses, with the ranges it enforces; fields it refuses
(``suffix``, ``logit_bias``, ...) are listed as ``null``/``false`` only, so a fuzzer that follows the schema sends
requests the router accepts, and one that breaks it gets a 4xx with the :data:`ERROR` body.
"""

from __future__ import annotations

from typing import Any

from .protocol import MAX_CHOICES, UNSUPPORTED_FIELDS

_REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_INT64 = 2 ** 63

# (name, schema, description) for the fields both generation endpoints take (protocol._parse_common).
_COMMON: list[tuple[str, dict[str, Any], str]] = [
    ("model", _STR, "the served model name (GET /v1/models); omitted: the one model"),
    ("stream", _BOOL, "answer with server-sent events"),
    ("stream_options", {"type": "object", "properties": {"include_usage": _BOOL,
                                                         "continuous_usage_stats": _BOOL}},
     "only with stream: true"),
    ("stop", {"anyOf": [_STR, {"type": "array", "items": _STR}]}, "stop string(s)"),
    ("stop_token_ids", _TOKEN_IDS, "token ids that end the generation"),
    ("include_stop_str_in_output", _BOOL, "keep the matched stop string in the text"),
    ("temperature", {"type": "number", "minimum": 0}, "sampling temperature"),
    ("top_p", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "nucleus sampling"),
    ("min_p", {"type": "number", "minimum": 0, "maximum": 1}, "min-p sampling"),
    ("repetition_penalty", {"type": "number", "exclusiveMinimum": 0}, "vLLM repetition penalty"),
    ("top_k", {"type": "integer", "minimum": -1}, "top-k sampling (-1: off)"),
    ("seed", {"type": "integer", "minimum": -_INT64, "maximum": _INT64 - 1}, "sampling seed"),
    ("ignore_eos", _BOOL, "keep generating past EOS"),
    ("skip_special_tokens", _BOOL, "drop special tokens from the text"),
    ("spaces_between_special_tokens", _BOOL, "vLLM detokenization option"),
    ("presence_penalty", {"type": "number", "minimum": -2, "maximum": 2}, "penalty on tokens already output"),
    ("frequency_penalty", {"type": "number", "minimum": -2, "maximum": 2}, "penalty by output token count"),
    ("logit_bias", {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
     "token id (as a string) -> bias added to its logit"),
    ("allowed_token_ids", _TOKEN_IDS, "sample only these token ids"),
    ("bad_words", {"type": "array", "items": _STR}, "words never generated"),
    ("cache_salt", {"type": "string", "minLength": 1, "maxLength": 1024},
     "salts the workers' prefix caches: requests with another salt never reuse this one's KV"),
    ("priority", {"type": "integer", "minimum": -_INT64, "maximum": _INT64 - 1},
     "scheduling priority (the workers must run priority scheduling for a value other than 0)"),
    ("return_tokens_as_token_ids", _BOOL, "logprobs' tokens as token_id:N"),
    ("request_id", {"type": "string", "minLength": 1}, "the answer's id is cmpl-/chatcmpl- + this"),
    ("n", {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
     "choices per prompt (the prompt is prefilled once)"),
    ("best_of", _nullable({"type": "integer", "const": 1}), "only 1 (or equal to n)"),
    ("prompt_logprobs", _nullable({"type": "integer", "minimum": -1}), "vLLM: logprobs of the prompt's tokens"),
    ("response_format", {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema", "structural_tag"]}, "json_schema": {"type": "object"}}},
     "structured output (JSON object or JSON schema)"),
    ("structured_outputs", {"type": "object", "oneOf": [
        {"required": [k], "properties": {k: {"not": {"type": "null"}}}}
        for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")]},
     "vLLM structured outputs: exactly one of json, regex, choice, grammar, json_object, structural_tag"),
    ("return_token_ids", _BOOL, "add token ids to the response (vLLM extension)"),
    ("truncate_prompt_tokens", _nullable({"type": "integer", "minimum": -1, "maximum": _INT64 - 1}),
     "keep this many prompt tokens (-1: the context less one); the router truncates before placement"),
    ("truncation_side", _nullable({"enum": ["left", "right"]}),
     "left keeps the last tokens (the default), right the first"),
    ("pdserve_timings", _BOOL, "add the router's per-phase timings to the response"),
]

_COMPLETION: list[tuple[str, dict[str, Any], str]] = [
    ("prompt", {"anyOf": [{"type": "string", "minLength": 1}, {**_TOKEN_IDS, "minItems": 1},
                          {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
                           "items": {"anyOf": [{"type": "string", "minLength": 1}, {**_TOKEN_IDS, "minItems": 1}]}}]},
     "one prompt: text or token ids"),
    ("max_tokens", _nullable({"type": "integer", "minimum": 1}), "default 16 (null too, as vLLM 0.32)"),
    ("add_special_tokens", _BOOL, "add the tokenizer's special tokens (default true)"),
    ("echo", _BOOL, "put the prompt (and its logprobs) before the output"),
    ("logprobs", _nullable({"type": "integer", "minimum": 0}), "logprobs of each output token and N alternatives"),
]

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _STR}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": _STR, "name": _STR,
    "content": _nullable({"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]})}}

_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": _STR, "description": _STR, "parameters": {"type": "object"}}}}}

_CHAT: list[tuple[str, dict[str, Any], str]] = [
    ("messages", {"type": "array", "minItems": 1, "items": _MESSAGE}, "the conversation"),
    ("max_tokens", _nullable({"type": "integer", "minimum": 1}), "default: up to the context limit"),
    ("max_completion_tokens", _nullable({"type": "integer", "minimum": 1}), "takes precedence over max_tokens"),
    ("add_generation_prompt", _BOOL, "end the rendered prompt with the assistant turn (default true)"),
    ("continue_final_message", _BOOL, "continue the last message instead (not with add_generation_prompt)"),
    ("chat_template_kwargs", {"type": "object"}, "extra variables for the chat template"),
    ("add_special_tokens", _BOOL, "default false (the template has them)"),
    ("logprobs", _nullable(_BOOL), "logprobs of each output token"),
    ("top_logprobs", _nullable({"type": "integer", "minimum": 0}), "alternatives per token (with logprobs: true)"),
    ("tools", {"type": "array", "minItems": 1, "items": _TOOL},
     "functions the model may call (rendered by the chat template)"),
    ("tool_choice", {"anyOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                        "properties": {"name": _STR}}}}]},
     "none, auto (parsed by --tool-call-parser), required or a named function (constrained decoding)"),
    ("parallel_tool_calls", _BOOL, "allow several tool calls in one answer (default true)"),
]

# /v1/messages (Anthropic Messages API) and /v1/responses (OpenAI Responses API): run as chat requests
# (.messages_request, .responses_request); the fields those modules refuse are listed as null/false only.
_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "tool_use", "tool_result", "redacted_thinking"]}, "text": _STR, "id": _STR,
    "name": _STR, "input": {"type": "object"}, "tool_use_id": _STR,
    "content": {"anyOf": [_STR, {"type": "array", "items": {"type": "object"}}]}}}
_MESSAGES_REQUEST: dict[str, Any] = {
    "type": "object", "required": ["model", "messages", "max_tokens"], "additionalProperties": True, "properties": {
        "model": {"type": "string", "minLength": 1}, "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"enum": ["user", "assistant", "system"]},
                "content": {"anyOf": [_STR, {"type": "array", "items": _BLOCK}]}}}},
        "system": {"anyOf": [_STR, {"type": "array", "items": _BLOCK}]}, "stream": _BOOL,
        "stop_sequences": {"type": "array", "items": _STR}, "metadata": {"type": "object"},
        "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number", "exclusiveMinimum": 0,
                                                                   "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1}, "cache_salt": {"type": "string", "minLength": 1},
        "chat_template_kwargs": {"type": "object"},
        "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
            "name": _STR, "description": _STR, "input_schema": {"type": "object"}}}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "name": _STR, "disable_parallel_tool_use": _BOOL}},
        "output_config": {"type": "object", "properties": {"format": {"type": "object", "properties": {
            "type": {"const": "json_schema"}, "schema": {"type": "object"}}}}},
        **{name: {"type": "null", "description": "not supported"} for name in
           ("kv_transfer_params", "ec_transfer_params")},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["enabled", "disabled", "adaptive"]}, "budget_tokens": {"type": "integer",
                                                                                     "minimum": 1024}}}}}
_INPUT_ITEM = {"type": "object", "properties": {
    "type": {"enum": ["message", "function_call", "function_call_output"]},
    "role": {"enum": ["user", "system", "developer", "assistant"]},
    "content": {"anyOf": [_STR, {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                                            "properties": {"type": {"enum": ["input_text",
                                                                                             "output_text"]},
                                                                           "text": _STR}}}]},
    "call_id": _STR, "name": _STR, "arguments": _STR, "output": _STR, "status": _STR}}
_RESPONSES_REQUEST: dict[str, Any] = {
    "type": "object", "required": ["input"], "additionalProperties": True, "properties": {
        **{name: {**schema, "description": desc} for name, schema, desc in _COMMON
           if name in ("model", "stream", "stop", "stop_token_ids", "include_stop_str_in_output", "temperature",
                       "top_p", "min_p", "repetition_penalty", "top_k", "seed", "ignore_eos", "skip_special_tokens",
                       "presence_penalty", "frequency_penalty", "cache_salt", "priority", "structured_outputs")},
        "input": {"anyOf": [_STR, {"type": "array", "items": _INPUT_ITEM}]}, "instructions": _STR,
        "max_output_tokens": _nullable({"type": "integer", "minimum": 1}),
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"}, "name": _STR, "description": _STR, "parameters": {"type": "object"}}}},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                        "name": _STR}}]},
        "parallel_tool_calls": _BOOL, "store": _BOOL, "metadata": {"type": "object"}, "user": _STR,
        "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}, "schema": {"type": "object"}}}}},
        "reasoning": {"type": "object", "properties": {"effort": _STR}},
        "truncation": {"const": "disabled"},
        **{name: {"anyOf": [{"type": "null"}, {"const": False}], "description": "stateful: not supported"} for name in
           ("previous_response_id", "background", "previous_input_messages", "enable_response_messages")},
        **{name: {"type": "null", "description": "not supported"} for name in
           ("prompt", "kv_transfer_params", "ec_transfer_params")},
        "include": {"type": "array", "items": _STR}, "top_logprobs": {"type": "integer", "minimum": 0}}}
ANTHROPIC_ERROR: dict[str, Any] = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": _STR, "message": _STR}}}}

ERROR: dict[str, Any] = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": _STR, "type": _STR, "param": _nullable(_STR), "code": _nullable(_STR)}}}}

_ANY_OBJECT = {"type": "object", "additionalProperties": True}
_SSE_EVENT = {"type": "object", "properties": {"data": _STR, "event": _STR}}  # one server-sent event


def _request_schema(fields: list[tuple[str, dict[str, Any], str]], unsupported: tuple[str, ...],
                    required: str) -> dict[str, Any]:
    props = {name: {**schema, "description": desc} for name, schema, desc in _COMMON + fields}
    for name in unsupported:
        props.setdefault(name, {"anyOf": [{"type": "null"}, {"const": False}], "description": "not supported"})
    return {"type": "object", "required": [required], "properties": props, "additionalProperties": True,
            # as vLLM: stream_options only with stream: true
            "dependentSchemas": {"stream_options": {"required": ["stream"], "properties": {"stream": {"const": True}}}}}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int, schema: str = "Error") -> dict[str, Any]:
    text = {400: "invalid request", 403: "not allowed from this client", 404: "unknown model or worker",
            413: "body over --max-body-bytes", 429: "predicted to miss the SLO", 502: "a worker failed",
            503: "no healthy worker", 504: "the request's deadline passed"}
    return {str(s): {"description": text[s], "content": _json(_ref(schema))} for s in statuses}


def _generation(summary: str, schema: str, error: str = "Error") -> dict[str, Any]:
    return {"post": {"summary": summary, "operationId": schema[0].lower() + schema[1:-len("Request")],
                     "requestBody": {"required": True, "content": _json(_ref(schema))},
                     "responses": {"200": {"description": "the completion (JSON), or server-sent events with "
                                                          "stream: true",
                                           "content": {**_json(_ANY_OBJECT),
                                                       "text/event-stream": {"schema": _SSE_EVENT}}},
                                   **_errors(400, 404, 413, 429, 502, 503, schema=error)}}}


def _get(summary: str, op: str, content_type: str = "application/json", *statuses: int) -> dict[str, Any]:
    schema = _ANY_OBJECT if content_type == "application/json" else _STR
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
    body = {"required": False, "content": _json(_ref("WorkerChange"))}
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


def openapi_document(model: str, max_model_len: int, max_body_bytes: int) -> dict[str, Any]:
    """The OpenAPI 3.1 description of this router's endpoints (its limits in the info text)."""
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
            "/openapi.json": _get("this document", "openapi"),
            "/tokenize": _post("token ids of a prompt or a chat (as vLLM's /tokenize)", "tokenize", {
                "type": "object", "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
                "properties": {"prompt": _STR, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                                                 "add_special_tokens": _BOOL, "return_token_strs": _BOOL}}),
            "/detokenize": _post("text of token ids (as vLLM's /detokenize)", "detokenize", {
                "type": "object", "required": ["tokens"], "properties": {"tokens": _TOKEN_IDS}}),
        },
        "components": {
            "schemas": {
                "CompletionRequest": _request_schema(_COMPLETION, UNSUPPORTED_FIELDS["completions"], "prompt"),
                "ChatCompletionRequest": _request_schema(_CHAT, UNSUPPORTED_FIELDS["chat"], "messages"),
                "MessagesRequest": _MESSAGES_REQUEST,
                "ResponsesRequest": _RESPONSES_REQUEST,
                "AnthropicError": ANTHROPIC_ERROR,
                "WorkerChange": _WORKER_BODY,
                "Error": ERROR,
            },
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer",
                                               "description": "$PDSERVE_ADMIN_TOKEN; without one, loopback only"}},
        },
    }
