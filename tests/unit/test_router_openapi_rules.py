"""The rules /openapi.json lists under x-pdserve-rules (api/openapi_rules.py) are the router's: for each kind the
document uses, a body that breaks it is refused with a 400 naming the field and one that keeps it is accepted;
the document uses no kind this file does not check. And the schemathesis hooks (schemathesis_rules.py) read each
kind as the document says."""

from __future__ import annotations

import pytest

from pdserve.router.api import messages_request, responses_request
from pdserve.router.api.openapi import openapi_document
from pdserve.router.api.openapi_rules import RULES_KEY
from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.errors import RouterError
from tests.unit import schemathesis_rules as hooks
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

MSG = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _refused(fn, body, param: str) -> None:
    with pytest.raises(RouterError) as e:
        fn(body)
    assert e.value.status == 400 and e.value.param == param, (e.value.message, e.value.param)


def _kinds(tool_parser: bool) -> set[str]:
    schemas = openapi_document("m", 64, 1 << 20, 100, tool_parser)["components"]["schemas"]
    return {r["rule"] for s in schemas.values() for r in s.get(RULES_KEY, [])}


def test_the_document_uses_only_the_kinds_checked_here():
    assert _kinds(False) | _kinds(True) == {"less", "in", "json", "exclusive", "keys_below", "context", "greedy_n"}


def test_less_thinking_budget_under_max_tokens():
    body = {"model": "m", "max_tokens": 2048, "messages": MSG, "thinking": {"type": "enabled", "budget_tokens": 2048}}
    _refused(messages_request.to_chat, body, "thinking")
    assert messages_request.to_chat({**body, "max_tokens": 2049})["thinking_token_budget"] == 2048
    rule = openapi_document("m", 64, 1 << 20, 100)["components"]["schemas"]["MessagesRequest"][RULES_KEY][0]
    assert hooks.breaks(body, rule) and not hooks.breaks({**body, "max_tokens": 2049}, rule)
    assert not hooks.breaks({**body, "thinking": {"type": "disabled", "budget_tokens": 5000}}, rule)  # "when"


def test_in_named_tool_choice_names_a_tool():
    body = {"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}
    _refused(parse_chat, body, "tool_choice")
    assert parse_chat({**body, "tool_choice": {"type": "function", "function": {"name": "f"}}}).constrained
    rule = {"rule": "in", "field": "/tool_choice/function/name", "among": "/tools/*/function/name"}
    assert hooks.breaks(body, rule) and not hooks.breaks({**body, "tool_choice": "auto"}, rule)


def test_json_function_call_arguments():
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}
    body = {"input": [{"role": "user", "content": "x"}, call]}
    _refused(lambda b: parse_chat(responses_request.to_chat(b)), body, "messages")
    parse_chat(responses_request.to_chat({"input": [{"role": "user", "content": "x"}, {**call, "arguments": "{}"}]}))
    rule = {"rule": "json", "items": "/input", "when": {"type": "function_call"}, "field": "arguments"}
    assert hooks.breaks(body, rule) and not hooks.breaks({"input": [{**call, "type": "message"}]}, rule)


def test_exclusive_response_format_or_structured_outputs():
    body = {"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}
    _refused(parse_completion, body, "structured_outputs")
    assert parse_completion({**body, "response_format": {"type": "text"}}).constrained
    rule = {"rule": "exclusive", "fields": ["/response_format", "/structured_outputs"],
            "unless": {"/response_format/type": "text"}}
    assert hooks.breaks(body, rule) and not hooks.breaks({**body, "response_format": {"type": "text"}}, rule)
    assert not hooks.breaks({**body, "structured_outputs": None}, rule)


def test_choices_are_vllms_bound_not_a_product_of_prompts():
    """Issue 41: n up to vLLM's VLLM_MAX_N_SEQUENCES whatever the number of prompts (vLLM has no n x prompts
    limit); greedy n > 1 refused as vLLM refuses it (unnamed)."""
    assert parse_completion({"prompt": ["a", "b"], "n": 65, "temperature": 1}).n == 65
    _refused(parse_completion, {"prompt": "a", "n": 16385, "temperature": 1}, None)
    _refused(parse_completion, {"prompt": "a", "n": 2, "temperature": 0}, None)
    rule = {"rule": "greedy_n", "n": "/n", "temperature": "/temperature", "eps": 1e-5}
    assert hooks.breaks({"n": 2, "temperature": 0}, rule) and not hooks.breaks({"n": 2, "temperature": 0.5}, rule)
    assert not hooks.breaks({"n": 2}, rule) and not hooks.breaks({"n": 1, "temperature": 0}, rule)


def test_keys_below_and_context_are_the_apps(model_dir, tokenizer):  # noqa: F811
    async def main():
        async with Env(model_dir, tokenizer, prefill=[FakeWorker("P")], decode=[FakeWorker("D")]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "hello", "max_tokens": 1, "logit_bias": {"100": 1}})
            assert st == 400 and out["error"]["param"] == "logit_bias", out
            st, out = await env.post("/v1/completions", {"prompt": "hello", "max_tokens": 1, "logit_bias": {"99": 1}})
            assert st == 200, out
            st, out = await env.post("/v1/completions", {"prompt": [5] * 64, "max_tokens": 1})
            assert st == 400 and out["error"]["code"] == "context_length_exceeded", out
            st, out = await env.post("/v1/completions", {"prompt": "hello", "max_tokens": 65})
            assert st == 400 and out["error"]["param"] == "max_tokens", out
            st, out = await env.post("/v1/completions", {"prompt": "hello", "max_tokens": 64})
            assert st == 200, out  # over the room left: clamped to it, as vLLM
            st, out = await env.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 0,
                                                               "max_completion_tokens": 2})
            assert st == 200, out  # max_tokens counts only without max_completion_tokens
            st, out = await env.post("/v1/completions", {"prompt": [5] * 64, "max_tokens": 60,
                                                          "truncate_prompt_tokens": 10})
            assert st == 200, out  # a truncated prompt's budget: the room left
    run(main())


def test_context_hook_counts_as_the_router(model_dir, monkeypatch):  # noqa: F811
    monkeypatch.setenv(hooks.MODEL_ENV, str(model_dir))
    rule = {"rule": "context", "form": "completion", "max_model_len": 64, "output": ["/max_tokens"],
            "default_output": 16}
    assert not hooks.breaks({"prompt": "hello"}, rule)
    assert not hooks.breaks({"prompt": "hello", "max_tokens": 64}, rule)  # clamped to the room left, as vLLM
    assert hooks.breaks({"prompt": "hello", "max_tokens": 65}, rule)
    assert hooks.breaks({"prompt": [5] * 64, "max_tokens": 1}, rule)
    assert not hooks.breaks({"prompt": [5] * 64, "max_tokens": 60, "truncate_prompt_tokens": 10}, rule)
    chat = {**rule, "form": "chat", "output": ["/max_completion_tokens", "/max_tokens"], "default_output": None}
    assert not hooks.breaks({"messages": MSG, "max_tokens": 0, "max_completion_tokens": 2}, chat)
    assert hooks.breaks({"messages": MSG, "max_tokens": 0}, chat)
    messages = {**rule, "form": "messages", "output": ["/max_tokens"], "default_output": None}
    assert hooks.breaks({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": []}]}, messages)
