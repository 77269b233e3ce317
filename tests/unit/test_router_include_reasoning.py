"""Chat ``include_reasoning: false`` as vLLM 0.32 serves it with a parser (--tool-call-parser): the answer's text is
the same, but no choice shows its tokens' ids or logprobs, in the JSON answer, in every streamed chunk (the
common text chunk, the full path, the pass-through relay) and in the finish; the prompt's ids still show.
Without a parser the field changes nothing (vLLM's too)."""

from __future__ import annotations

import json

import pytest

from pdserve.router.app import Router
from pdserve.router.errors import RouterError
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

BODY = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "return_token_ids": True}


@pytest.fixture
def no_parser_import(monkeypatch):
    async def nothing(self):  # the parser is imported only for tool requests; none here
        return None
    monkeypatch.setattr(Router, "_load_tool_parser", nothing)


def _chunks(payloads: list[str]) -> list[dict]:
    return [json.loads(p) for p in payloads]


def _ask(model_dir, tokenizer, parser: str, bodies: list[dict]) -> list:  # noqa: F811
    out: list = []

    async def main():
        async with Env(model_dir, tokenizer, prefill=[FakeWorker("P")], decode=[FakeWorker("D")],
                       tool_call_parser=parser) as env:
            for body in bodies:
                if body.get("stream"):
                    st, payloads = await env.stream("/v1/chat/completions", body)
                    out.append((st, _chunks(payloads)))
                else:
                    out.append(await env.post("/v1/chat/completions", body))
    run(main())
    return out


def _stream_view(chunks: list[dict]) -> tuple[str, list[int], list, list]:
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
    ids = [t for c in chunks if c.get("choices") for t in c["choices"][0].get("token_ids") or []]
    lps = [c["choices"][0].get("logprobs") for c in chunks if c.get("choices")]
    prompt = [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c]
    return text, ids, lps, prompt


def test_hidden_token_details_with_a_parser(model_dir, tokenizer, no_parser_import):  # noqa: F811
    shown, hidden, s_shown, s_hidden, relay_shown, relay_hidden = _ask(model_dir, tokenizer, "hermes", [
        {**BODY, "logprobs": True, "top_logprobs": 2}, {**BODY, "logprobs": True, "top_logprobs": 2,
                                                        "include_reasoning": False},
        {**BODY, "stream": True, "logprobs": True}, {**BODY, "stream": True, "logprobs": True,
                                                     "include_reasoning": "no"},
        {**BODY, "stream": True}, {**BODY, "stream": True, "include_reasoning": False}])
    (st, a), (st2, b) = shown, hidden
    assert st == st2 == 200
    assert a["choices"][0]["token_ids"] and a["choices"][0]["logprobs"] is not None  # (the fake has no values)
    assert "token_ids" not in b["choices"][0] and b["choices"][0]["logprobs"] is None
    assert b["choices"][0]["message"] == a["choices"][0]["message"] and b["usage"] == a["usage"]
    assert b["prompt_token_ids"] == a["prompt_token_ids"]
    # (the fake worker has no logprobs to stream: the conformance suite checks streamed ones against vLLM)
    for shown_stream, hidden_stream in ((s_shown, s_hidden), (relay_shown, relay_hidden)):
        text, ids, _, prompt = _stream_view(shown_stream[1])
        text2, ids2, lps2, prompt2 = _stream_view(hidden_stream[1])
        assert text2 == text and prompt2 == prompt and prompt  # the prompt's ids still show
        assert ids and ids2 == [] and all(lp is None for lp in lps2)


def test_no_effect_without_a_parser(model_dir, tokenizer):  # noqa: F811
    (st, a), (st2, b) = _ask(model_dir, tokenizer, "", [BODY, {**BODY, "include_reasoning": False}])
    assert st == st2 == 200 and b["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]


def test_include_reasoning_is_a_boolean_and_never_null():
    from pdserve.router.api.protocol import parse_chat

    assert parse_chat({**BODY, "include_reasoning": "off"}).include_reasoning is False
    for bad in (None, "maybe"):
        with pytest.raises(RouterError) as e:
            parse_chat({**BODY, "include_reasoning": bad})
        assert e.value.status == 400 and e.value.param == "include_reasoning"
