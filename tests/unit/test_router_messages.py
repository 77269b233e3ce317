"""/v1/messages (Anthropic Messages API) through the router's P -> D path, over fake workers: the request's
translation to chat, the answer's shapes (whole and SSE events), and errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.router.api.chat_output import ChatPiece
from pdserve.router.api.messages_request import to_chat
from pdserve.router.api.messages_stream import MessageEvents, message_body, stop_reason
from pdserve.router.errors import RouterError
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

BODY = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "the cat sat"}],
        "temperature": 0}


def _events(raw: str) -> list[tuple[str, dict]]:
    out = []
    assert raw.endswith("\n\n")
    for ev in raw.split("\n\n")[:-1]:
        name, data = ev.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[len("data: "):])
        assert obj["type"] == name[len("event: "):]
        out.append((obj["type"], obj))
    return out


async def _sse(env: Env, path: str, body: dict) -> tuple[int, str]:
    async with env.session.post(env.url + path, json=body) as r:
        return r.status, (await r.read()).decode()


def test_messages_through_p_and_d_whole_and_streamed(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/messages", {**BODY, "system": "a b"})
            assert st == 200, out
            assert out["type"] == "message" and out["role"] == "assistant" and out["model"] == "tiny"
            assert out["content"] == [{"type": "text", "text": " hello world the cat"}]
            assert out["stop_reason"] == "max_tokens" and "stop_sequence" not in out
            # the system prompt renders first: "<|system|> a b <|user|> the cat sat <|assistant|>" (8 words)
            assert out["usage"] == {"input_tokens": 8, "output_tokens": 4}
            assert out["id"].startswith("chatcmpl-")
            assert len(p.requests) == 1 and p.requests[0]["max_tokens"] == 1  # P's prefill, then D
            assert d.requests[0]["kv_transfer_params"]["remote_engine_id"] == "P"

            st, raw = await _sse(env, "/v1/messages", {**BODY, "stream": True})
            assert st == 200, raw
            events = _events(raw)
            names = [n for n, _ in events]
            assert names[0] == "message_start" and names[1] == "content_block_start"
            assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
            start = events[0][1]["message"]
            assert start["content"] == [] and start["stop_reason"] is None and start["stop_sequence"] is None
            assert start["usage"] == {"input_tokens": 5, "output_tokens": 0}
            text = "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta")
            assert text == " hello world the cat"
            assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
            assert events[-2][1]["usage"] == {"input_tokens": 5, "output_tokens": 4}
    run(main())


def test_messages_stop_sequence_and_errors_in_anthropic_shape(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/messages", {**BODY, "max_tokens": 8, "stop_sequences": ["mat"]})
            assert st == 200 and out["stop_reason"] == "stop_sequence" and out["stop_sequence"] == "mat"
            assert out["content"][0]["text"] == " hello world the cat sat on "
            for body, status in (({k: v for k, v in BODY.items() if k != "max_tokens"}, 400),
                                 ({**BODY, "model": "nope"}, 404), ({**BODY, "max_tokens": 0}, 400),
                                 ({**BODY, "max_tokens": 500}, 400), ({**BODY, "thinking": {"type": "enabled"}}, 400),
                                 ({**BODY, "messages": [{"role": "tool", "content": "x"}]}, 400), ("{bad", 400),
                                 ({**BODY, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400)):
                st, out = await env.post("/v1/messages", body)
                assert st == status, (body, out)
                assert out["type"] == "error" and set(out["error"]) == {"type", "message"}, out
    run(main())


def test_messages_request_translation():
    chat = to_chat({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "x-anthropic-billing-header: 1"},
                                                               {"type": "text", "text": "sys"}],
                    "stop_sequences": ["z"], "top_k": 3, "top_p": 0.5, "cache_salt": "s", "metadata": {"u": 1},
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                 {"role": "assistant", "content": [
                                     {"type": "text", "text": "ok"},
                                     {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                               "content": [{"type": "text", "text": "42"}]}]}],
                    "tools": [{"name": "f", "input_schema": {"properties": {}}}],
                    "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert chat["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"}]
    assert chat["max_tokens"] == 5 and chat["stop"] == ["z"] and chat["top_k"] == 3 and chat["cache_salt"] == "s"
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"][0]["function"]["parameters"] == {"properties": {}, "type": "object"}
    assert "metadata" not in chat and chat["stream"] is False
    named = to_chat({**BODY, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "f"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    for bad, param in (({**BODY, "kv_transfer_params": {}}, "kv_transfer_params"),
                       ({**BODY, "tool_choice": {"type": "tool"}}, "tool_choice"),
                       ({**BODY, "stop_sequences": "z"}, "stop_sequences"), ({**BODY, "temperature": "x"}, "temperature"),
                       ({**BODY, "tools": [{"name": "f"}]}, "tools")):
        with pytest.raises(RouterError) as e:
            to_chat(bad)
        assert e.value.status == 400 and e.value.param == param


def test_stop_reason_rules():
    assert stop_reason("length", None, True, True) == ("max_tokens", None)
    assert stop_reason("stop", "x", False, False) == ("stop_sequence", "x")
    assert stop_reason("stop", "x", True, True) == ("tool_use", None)
    assert stop_reason("stop", None, True, False) == ("tool_use", None)
    assert stop_reason("tool_calls", None, False, False) == ("tool_use", None)
    assert stop_reason("stop", 2, False, False) == ("end_turn", None)


def test_message_body_blocks():
    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    out = message_body("m1", "tiny", msg, "tool_calls", None, 3, 2)
    assert out["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]
    assert out["stop_reason"] == "tool_use" and out["usage"] == {"input_tokens": 3, "output_tokens": 2}
    empty = message_body("m1", "tiny", {"role": "assistant", "content": ""}, "stop", None, 3, 0)
    assert empty["content"] == [{"type": "text", "text": ""}] and empty["stop_reason"] == "end_turn"
    bad = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}
    with pytest.raises(RouterError) as e:  # a 502 in Anthropic's shape, never a 500
        message_body("m1", "tiny", bad, "tool_calls", None, 3, 2)
    assert e.value.status == 502


def test_stream_events_hold_text_inside_a_tool_block():
    ev = MessageEvents("m1", "tiny", 5)
    raw = ev.start() + ev.feed(ChatPiece({"content": "hi"}))
    raw += ev.feed(ChatPiece({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{"}}]}))
    raw += ev.feed(ChatPiece({"content": "late"}))
    raw += ev.feed(ChatPiece({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}))
    raw += ev.finish(ChatPiece({}, "tool_calls"), 7)
    events = _events(raw.decode())
    seq = [(n, e.get("index")) for n, e in events]
    assert seq == [("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
                   ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                   ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
                   ("content_block_delta", 2), ("content_block_stop", 2), ("message_delta", None),
                   ("message_stop", None)]
    assert events[4][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert events[9][1]["delta"] == {"type": "text_delta", "text": "late"}
    assert events[11][1]["delta"]["stop_reason"] == "tool_use"


def test_every_vllm_messages_field_is_classified_and_refusals_name_the_field():
    pytest.importorskip("vllm")
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    from pdserve.router.api.agent_fields import MESSAGES, counts

    assert sorted(set(AnthropicMessagesRequest.model_fields) ^ set(MESSAGES)) == [], \
        "classify these in pdserve/router/api/agent_fields.py"
    assert sum(counts("messages").values()) == len(MESSAGES)
    values = {"thinking": {"type": "enabled", "budget_tokens": 1024}, "kv_transfer_params": {"a": 1},
              "ec_transfer_params": {"a": 1}}
    for name, (kind, _) in MESSAGES.items():
        if kind == "refused":
            with pytest.raises(RouterError) as e:
                to_chat({**BODY, name: values[name]})
            assert e.value.status == 400 and e.value.param == name
        elif kind == "same":
            same = {"max_tokens": 4, "temperature": 0.5, "top_p": 0.5, "top_k": 2, "cache_salt": "s",
                    "watermarking": True, "vllm_xargs": {"a": 1}, "chat_template_kwargs": {"a": 1}}
            assert to_chat({**BODY, name: same[name]})[name] == same[name], name


def test_messages_worker_error_client_leaving_and_metrics(model_dir, tokenizer):
    async def main():
        async with Env(model_dir, tokenizer, [FakeWorker("P", status=400)], [FakeWorker("D")]) as env:
            st, out = await env.post("/v1/messages", BODY)  # a worker's 400 before the first token: its status
            assert st == 400 and out["type"] == "error" and "fake error from P" in out["error"]["message"]
        p, d = FakeWorker("P"), FakeWorker("D", delay_s=0.05)
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            async with env.session.post(env.url + "/v1/messages", json={**BODY, "max_tokens": 40, "stream": True}) as r:
                assert r.status == 200
                seen = 0
                async for line in r.content:
                    seen += line.startswith(b"event: content_block_delta")
                    if seen == 3:
                        break
                r.close()  # the client hangs up mid-stream: D's request is aborted
            await asyncio.wait_for(d.aborted.wait(), 5)
            assert d.finished == 0
            st, out = await env.post("/v1/messages", BODY)
            assert st == 200
            st, text = await env.get("/metrics")
            assert 'pdserve_router_requests_total{endpoint="messages",status="200"} 1.0' in text
    run(main())


def test_inline_system_messages_merge_only_for_a_system_first_template():
    body = {**BODY, "system": "s1", "messages": [{"role": "user", "content": "u1"}, {"role": "system", "content": "s2"},
                                                 {"role": "user", "content": "u2"}]}
    assert [m["role"] for m in to_chat(body)["messages"]] == ["system", "user", "system", "user"]
    merged = to_chat(body, merge_inline_system=True)["messages"]
    assert merged == [{"role": "system", "content": "s1s2"}, {"role": "user", "content": "u1"},
                      {"role": "user", "content": "u2"}]

    from pdserve.router.endpoints.anthropic_messages import MessagesEndpoint

    class Strict:  # a template with Qwen's loop.first guard on system messages
        def render_chat(self, messages, add_generation_prompt=True, **kw):
            if any(m["role"] == "system" for m in messages[1:]):
                raise RouterError(400, "chat template failed")
            return ""

    assert MessagesEndpoint(None, Strict()).merge_inline_system() is True  # type: ignore[arg-type]


def test_thinking_maps_to_a_budget_or_an_effort():
    assert to_chat({**BODY, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}}
                   )["thinking_token_budget"] == 1024
    assert to_chat({**BODY, "thinking": {"type": "disabled"}}, disabled_effort="low")["reasoning_effort"] == "low"
    adaptive = to_chat({**BODY, "thinking": {"type": "adaptive", "display": "omitted"}})
    assert "reasoning_effort" not in adaptive and "thinking_token_budget" not in adaptive
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "enabled", "budget_tokens": 10},
                     {"type": "maybe"}, "yes"):
        with pytest.raises(RouterError) as e:
            to_chat({**BODY, "thinking": thinking})
        assert e.value.status == 400 and e.value.param == "thinking"

    from pdserve.router.endpoints.anthropic_messages import MessagesEndpoint

    class Plain:  # a template that never reads reasoning_effort: "none" renders as every effort, so "low"
        def render_chat(self, messages, add_generation_prompt=True, **kw):
            return "same"

    class Honours:
        def render_chat(self, messages, add_generation_prompt=True, **kw):
            return kw["reasoning_effort"]

    assert MessagesEndpoint(None, Plain()).disabled_effort() == "low"  # type: ignore[arg-type]
    assert MessagesEndpoint(None, Honours()).disabled_effort() == "none"  # type: ignore[arg-type]
