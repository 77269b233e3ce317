"""/v1/responses (OpenAI Responses API, stateless) through the router's P -> D path, over fake workers: the
request's translation to chat, the response object and its SSE events, the stateful fields refused by name."""

from __future__ import annotations

import json

import pytest

from pdserve.router.api.chat_output import ChatPiece
from pdserve.router.api.responses_request import to_chat
from pdserve.router.api.responses_shape import ResponseEvents, ResponseShape, output_items
from pdserve.router.errors import RouterError
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

BODY = {"model": "tiny", "max_output_tokens": 4, "input": "the cat sat", "temperature": 0}


def _events(raw: str) -> list[dict]:
    out = []
    assert raw.endswith("\n\n")
    for k, ev in enumerate(raw.split("\n\n")[:-1]):
        name, data = ev.split("\n")
        obj = json.loads(data[len("data: "):])
        assert name == "event: " + obj["type"] and obj["sequence_number"] == k
        out.append(obj)
    return out


def test_responses_through_p_and_d_whole_and_streamed(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/responses", {**BODY, "instructions": "a b", "metadata": {"k": "v"}})
            assert st == 200, out
            assert out["object"] == "response" and out["id"].startswith("resp_") and out["model"] == "tiny"
            assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
            [item] = out["output"]
            assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
            assert item["content"] == [{"annotations": [], "text": " hello world the cat", "type": "output_text",
                                        "logprobs": None}]
            assert out["usage"]["input_tokens"] == 8 and out["usage"]["output_tokens"] == 4
            assert out["usage"]["total_tokens"] == 12
            assert out["instructions"] == "a b" and out["metadata"] == {"k": "v"} and out["tool_choice"] == "none"
            assert out["temperature"] == 0.0 and out["top_p"] == 1.0 and out["max_output_tokens"] == 4
            assert p.requests[0]["max_tokens"] == 1 and d.requests[0]["kv_transfer_params"]["remote_engine_id"] == "P"

            async with env.session.post(env.url + "/v1/responses", json={**BODY, "stream": True}) as r:
                assert r.status == 200
                events = _events((await r.read()).decode())
            kinds = [e["type"] for e in events]
            assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
            assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done", "response.completed"]
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == " hello world the cat" == events[-4]["text"]
            final = events[-1]["response"]
            assert final["output"] == [events[-2]["item"]] and final["usage"]["output_tokens"] == 4
            assert final["id"] == events[0]["response"]["id"] and events[0]["response"]["status"] == "in_progress"
    run(main())


def test_responses_refuses_stateful_fields_and_bad_input(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/responses", {**BODY, "store": True, "request_id": "r1"})
            assert st == 200 and out["id"] == "r1"  # store: nothing stored, as vLLM without its store
            for body, status, param in (
                    ({**BODY, "previous_response_id": "resp_1"}, 400, "previous_response_id"),
                    ({**BODY, "background": True}, 400, "background"),
                    ({**BODY, "include": "message.output_text.logprobs"}, 400, "include"),
                    ({**BODY, "include": ["message.output_text.logprobs"], "top_logprobs": -2}, 400,
                     "top_logprobs"),  # -1 (the whole vocabulary) goes to the workers, as on vLLM
                    ({**BODY, "user": 5}, 400, "user"), ({**BODY, "tools": {}}, 400, "tools"),
                    ({**BODY, "input": 5}, 400, "input"), ({"model": "tiny"}, 400, "input"),
                    ({**BODY, "model": "nope"}, 404, "model"), ({**BODY, "max_output_tokens": 0}, 400,
                                                                "max_output_tokens"),
                    ({**BODY, "max_output_tokens": 500}, 400, "max_output_tokens"),
                    ({**BODY, "input": "the cat " * 40}, 400, "input"),
                    ({**BODY, "tools": [{"type": "web_search"}]}, 400, "tools"),
                    ({**BODY, "input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
                    ({**BODY, "tool_choice": "required"}, 400, "tool_choice")):
                st, out = await env.post("/v1/responses", body)
                assert st == status and out["error"]["param"] == param, (body, out)
    run(main())


def test_responses_input_items_become_chat_messages():
    chat = to_chat({"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "d1"}, {"type": "input_text", "text": "d2"}]},
        {"type": "message", "role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}],
        "instructions": "sys", "top_k": 2, "seed": 3, "text": {"format": {"type": "json_object"}},
        "reasoning": {"effort": "low"}, "tools": [{"type": "function", "name": "f", "parameters": {}}],
        "tool_choice": {"type": "function", "name": "f"}, "store": True, "user": "u"})
    assert chat["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "developer", "content": "d1\nd2"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert chat["top_k"] == 2 and chat["seed"] == 3 and chat["structured_outputs"] == {"json_object": True}
    assert chat["reasoning_effort"] == "low" and chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert "store" not in chat and "user" not in chat and "max_tokens" not in chat
    cont = to_chat({"input": [{"role": "user", "content": "q"}, {"type": "message", "role": "assistant", "status":
                               "incomplete", "content": [{"type": "output_text", "text": "par"}]}]})
    assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
    with pytest.raises(RouterError) as e:
        to_chat({"input": "x", "truncation": "auto"})
    assert e.value.param == "truncation"


def test_streamed_tool_call_items_and_whole_output_items():
    shape = ResponseShape({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tiny", 9)
    ev = ResponseEvents(shape, 3)
    raw = ev.start() + ev.feed(ChatPiece({"content": "hi"}))
    raw += ev.feed(ChatPiece({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{"}}]}))
    raw += ev.feed(ChatPiece({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}))
    raw += ev.finish(ChatPiece({}, "tool_calls"), 4)
    events = _events(raw.decode())
    kinds = [e["type"] for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                         "response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]
    call = events[-2]["item"]
    assert call["call_id"] == "c1" and call["arguments"] == "{}" and call["status"] == "completed"
    assert events[-2]["output_index"] == 1 and events[-1]["response"]["status"] == "completed"
    assert events[-1]["response"]["tools"][0]["name"] == "f" and events[-1]["response"]["tool_choice"] == "auto"
    items = output_items({"content": None, "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, True)
    assert [i["type"] for i in items] == ["function_call"] and items[0]["id"].startswith("fc_")
    assert output_items({"content": ""}, False)[0]["content"] == []


def test_every_vllm_responses_field_is_classified_and_refusals_name_the_field():
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    from pdserve.router.api.agent_fields import RESPONSES, counts

    assert sorted(set(ResponsesRequest.model_fields) ^ set(RESPONSES)) == [], \
        "classify these in pdserve/router/api/agent_fields.py"
    assert sum(counts("responses").values()) == len(RESPONSES)
    values = {"include": ["message.output_text.logprobs"], "truncation": "auto", "previous_response_id": "r",
              "previous_input_messages": [{"role": "user", "content": "x"}], "background": True,
              "enable_response_messages": True, "prompt": {"id": "p"}, "kv_transfer_params": {"a": 1},
              "ec_transfer_params": {"a": 1}}
    for name, (kind, _) in RESPONSES.items():
        if kind == "refused":
            with pytest.raises(RouterError) as e:
                to_chat({**BODY, name: values[name]})
            assert e.value.status == 400 and e.value.param == name
        elif kind == "same":
            assert name in to_chat({**BODY, name: 1}), name


def test_output_logprobs_in_the_responses_shapes():
    chat = to_chat({**BODY, "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    entry = {"token": " a", "logprob": -0.5, "bytes": [32, 97],
             "top_logprobs": [{"token": " a", "logprob": -0.5, "bytes": [32, 97]}]}
    [item] = output_items({"content": " a"}, False, [entry])
    assert item["content"][0]["logprobs"] == [{"token": " a", "bytes": [32, 97], "logprob": -0.5,
                                               "top_logprobs": [{"token": " a", "bytes": [32, 97], "logprob": -0.5}]}]
    shape = ResponseShape({"include": ["message.output_text.logprobs"], "top_logprobs": 2}, "tiny", 4)
    ev = ResponseEvents(shape, 3)
    raw = ev.start() + ev.feed(ChatPiece({"content": " a"}, logprobs=[entry]))
    raw += ev.finish(ChatPiece({}, "length"), 1)
    events = _events(raw.decode())
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert delta["logprobs"] == [{"token": " a", "logprob": -0.5, "top_logprobs": [{"token": " a", "logprob": -0.5}]}]
    final = events[-1]["response"]
    assert final["top_logprobs"] == 2 and final["output"][0]["content"][0]["logprobs"][0]["bytes"] == [32, 97]
    assert ResponseShape({}, "tiny", 4).response([], "completed", None)["top_logprobs"] is None
