"""schemathesis hooks (``SCHEMATHESIS_HOOKS``) for tests/unit/test_router_schemathesis.py: the rules between fields
that /openapi.json lists under ``x-pdserve-rules`` (pdserve/router/api/openapi_rules.py says what each kind means),
where JSON Schema cannot state them, applied to the cases schemathesis generates as valid. A valid case that breaks
one is not valid under the document, so it is dropped; nothing else is changed, and the checks stay as they are.

The context rule counts a prompt's tokens as the router does (api/prompt.py, with the tokenizer of the model folder
in ``$PDSERVE_SCHEMATHESIS_MODEL``); the arithmetic on that count is this module's own."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import schemathesis
from schemathesis import GenerationMode

from pdserve.router.api import messages_request, responses_request
from pdserve.router.api.openapi_rules import RULES_KEY
from pdserve.router.api.prompt import prompt_ids
from pdserve.router.api.protocol import GenerationRequest, parse_chat, parse_completion
from pdserve.router.api.tokenizer import PromptTokenizer
from pdserve.router.errors import RouterError
from pdserve.router.run.beam_search import wants_beam_search

_MISSING = object()
MODEL_ENV = "PDSERVE_SCHEMATHESIS_MODEL"


def pointed(body: Any, pointer: str) -> Any:
    """The value at a JSON pointer (``/a/b``) in ``body``, or ``_MISSING``."""
    values = pointed_all(body, pointer)
    return values[0] if values else _MISSING


def pointed_all(body: Any, pointer: str) -> list[Any]:
    """Every value at a JSON pointer whose ``*`` parts stand for each item of a list (``/tools/*/name``)."""
    nodes = [body]
    for part in pointer.lstrip("/").split("/"):
        if part == "*":
            nodes = [item for node in nodes if isinstance(node, list) for item in node]
        else:
            nodes = [node[part] for node in nodes if isinstance(node, dict) and part in node]
    return nodes


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _json_text(v: Any) -> bool:
    if not isinstance(v, str) or not v:
        return True  # the schema types the field; an empty string is read as {}
    try:
        json.loads(v)
    except ValueError:
        return False
    return True


def _less(body: Any, rule: dict[str, Any]) -> bool:
    value, greater = pointed(body, rule["field"]), pointed(body, rule["than"])
    return _number(value) and _number(greater) and not value < greater


def _in(body: Any, rule: dict[str, Any]) -> bool:
    value = pointed(body, rule["field"])
    return value is not _MISSING and value not in pointed_all(body, rule["among"])


def _json(body: Any, rule: dict[str, Any]) -> bool:
    items = pointed(body, rule["items"])
    return isinstance(items, list) and any(
        not _json_text(item.get(rule["field"])) for item in items
        if isinstance(item, dict) and all(item.get(k) == v for k, v in rule["when"].items()))


def _prompts(prompt: Any) -> list[Any]:
    """A completion's prompts: a list of texts or token-id lists, else the one prompt."""
    many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    return list(prompt) if many else [prompt]


def _exclusive(body: Any, rule: dict[str, Any]) -> bool:
    if all(pointed(body, p) == v for p, v in rule["unless"].items()):
        return False
    return all(pointed(body, p) not in (None, _MISSING) for p in rule["fields"])


def _keys_below(body: Any, rule: dict[str, Any]) -> bool:
    keys = pointed(body, rule["field"])
    return isinstance(keys, dict) and any(k.isdigit() and int(k) >= rule["limit"] for k in keys)


@functools.cache
def _tokenizer() -> PromptTokenizer:
    return PromptTokenizer(os.environ[MODEL_ENV])


def _count(req: GenerationRequest, max_model_len: int) -> int | None:
    """The prompt's token count as the router takes it; -1 when it refuses the prompt's length; None for another
    refusal (the request itself is refused then, which the checks judge)."""
    try:
        return len(prompt_ids(_tokenizer(), req, max_model_len))
    except RouterError as e:
        return -1 if e.code == "context_length_exceeded" else None


_CHAT_FORMS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "chat": lambda body: body, "messages": messages_request.to_chat, "responses": responses_request.to_chat}


def _prompt_counts(form: str, body: Any, max_model_len: int) -> list[int | None]:
    """Each prompt's token count (after the chat template and truncation; -1: too long; None: unknown)."""
    try:
        if form == "completion":
            req = parse_completion(body)
            prompts = req.prompts or [req.prompt_ids if req.prompt_ids is not None else req.prompt_text or ""]
            return [_count(replace(req, prompt_text=p if isinstance(p, str) else None,
                                   prompt_ids=None if isinstance(p, str) else p), max_model_len) for p in prompts]
        chat = _CHAT_FORMS[form](body)
        if not chat.get("messages"):
            return [0]  # a chat form without messages has no prompt
        return [_count(parse_chat(chat), max_model_len)]
    except RouterError:
        return [None]


def _context(body: Any, rule: dict[str, Any]) -> bool:
    if not isinstance(body, dict):
        return False
    limit = rule["max_model_len"]
    budgets = [v for v in (pointed(body, p) for p in rule["output"]) if _number(v)]
    budget = budgets[0] if budgets else rule["default_output"]
    if budget is not None and (budget < 1 or budget > limit):
        return True
    return any(n is not None and (n in (-1, 0) or n >= limit)
               for n in _prompt_counts(rule["form"], body, limit))


def _greedy_n(body: Any, rule: dict[str, Any]) -> bool:
    n, t = pointed(body, rule["n"]), pointed(body, rule["temperature"])
    return _number(n) and n > 1 and _number(t) and t < rule["eps"]


_KINDS: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "less": _less, "in": _in, "json": _json, "exclusive": _exclusive, "keys_below": _keys_below,
    "context": _context, "greedy_n": _greedy_n}



def breaks(body: Any, rule: dict[str, Any]) -> bool:
    """Whether ``body`` breaks one documented rule (a kind this module does not know raises, so the document and
    this test grow together)."""
    kind = _KINDS.get(rule["rule"])
    if kind is None:
        raise ValueError(f"unknown rule kind in the document: {rule}")
    if rule["rule"] != "json" and any(pointed(body, p) != v for p, v in rule.get("when", {}).items()):
        return False
    return kind(body, rule)


def rules(operation: Any) -> list[dict[str, Any]]:
    """The rules of an operation's request body schema (a ``$ref`` into components, resolved)."""
    doc = operation.schema.raw_schema
    op = doc["paths"][operation.path][operation.method.lower()]
    schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    ref = schema.get("$ref")
    if ref is not None:
        schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return list(schema.get(RULES_KEY, []))


@schemathesis.hook
def after_call(context: Any, case: Any, response: Any) -> None:
    """A streamed request refused from inside the stream (vLLM 0.32's shape, run/answer.py refused_in_stream: 200, one
    error event, [DONE]) is judged as the refusal it is: its code as the status, its error object as the body."""
    if response.status_code != 200 or not response.content.startswith(b'data: {"error"'):
        return
    events = [e for e in response.content.decode().split("\n\n") if e]
    if len(events) != 2 or events[1] != "data: [DONE]":
        return
    err = json.loads(events[0][len("data: "):])
    if isinstance(err.get("error", {}).get("code"), int):
        response.status_code = err["error"]["code"]
        response.content = json.dumps(err).encode()
        for key in [k for k in response.headers if k.lower() == "content-type"]:
            response.headers[key] = ["application/json"]


MAX_CHOICES_HERE = 256  # n x prompts the fake workers answer within schemathesis' 10 s read timeout


def _too_many_choices(body: Any) -> bool:
    """A valid request of thousands of choices (n up to vLLM's 16,384) is served, one P -> D generation each: the
    harness's fake workers need minutes for it, so such cases are not sent here (test_router_api_units.py parses
    them; the conformance suite sends n past vLLM's bound)."""
    if not isinstance(body, dict):
        return False
    n = body.get("n")
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    return _number(n) and n * prompts > MAX_CHOICES_HERE


def _beam_search(body: Any) -> bool:
    """A beam search body goes to one worker as it is, and that worker (vLLM) checks it and answers for it
    (pdserve/router/run/beam_search.py): the harness's fake workers are not vLLM, so such cases are not sent here
    (tests/conformance and test_pd_router.py send beam search to real vLLM workers)."""
    return wants_beam_search(body)


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    if _too_many_choices(case.body) or _beam_search(case.body):
        return False
    if case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE or context.operation is None:
        return True
    return not any(breaks(case.body, rule) for rule in rules(context.operation))
