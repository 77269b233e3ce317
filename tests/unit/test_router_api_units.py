"""Issue 15's router pieces without workers: logprob shapes, choice merging, request parsing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.router.api.logprobs import LogprobTrack
from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.errors import RouterError
from pdserve.router.run.choices import Choice, choice_seed, merged, sum_usage
from pdserve.router.run.delta import Delta

P_PART = {"tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": [{" a": -0.5, " b": -1.0}], "text_offset": [0]}
D_PART = {"tokens": [" bc", "d"], "token_logprobs": [-0.25, -2.0],
          "top_logprobs": [{" bc": -0.25, " x": -3.0}, {"d": -2.0, "é": -2.5}], "text_offset": [0, 3]}


def test_completion_offsets_run_over_p_and_d_parts():
    t = LogprobTrack(chat=False, top=1)
    assert t.completion(P_PART)["text_offset"] == [0]
    assert t.completion(D_PART)["text_offset"] == [2, 5]  # D's own offsets (0, 3) rebased after P's token
    total = t.completion_total()
    assert total["tokens"] == [" a", " bc", "d"] and total["token_logprobs"] == [-0.5, -0.25, -2.0]
    assert t.completion(None) is None


def test_chat_shape_keeps_top_n_with_bytes():
    t = LogprobTrack(chat=True, top=1)
    part = t.chat_part(D_PART)
    assert part == {"content": [
        {"token": " bc", "logprob": -0.25, "bytes": [32, 98, 99],
         "top_logprobs": [{"token": " bc", "logprob": -0.25, "bytes": [32, 98, 99]}]},
        {"token": "d", "logprob": -2.0, "bytes": [100], "top_logprobs": [{"token": "d", "logprob": -2.0,
                                                                         "bytes": [100]}]}]}
    assert LogprobTrack(chat=True, top=0).chat_part(P_PART)["content"][0]["top_logprobs"] == []


def test_chat_bytes_under_return_tokens_as_token_ids_are_the_sampled_token_s_text_s_as_vllm():
    """vLLM 0.32 (seen on a worker): the sampled token's ``bytes`` are its text's (" Zhao" -> [32, 90, ...]), an
    alternative's are its ``token_id:N`` string's."""
    t = LogprobTrack(chat=True, top=1, decode={41663: " Zhao"}.__getitem__)
    part = t.chat_part({"tokens": ["token_id:41663"], "token_logprobs": [-0.01],
                        "top_logprobs": [{"token_id:41663": -0.01}]})
    entry = part["content"][0]
    assert entry["token"] == "token_id:41663" and entry["bytes"] == list(b" Zhao")
    assert entry["top_logprobs"][0]["bytes"] == list(b"token_id:41663")


def test_echo_prompt_part_from_prompt_logprobs():
    t = LogprobTrack(chat=False, top=1)
    rows = [None, {"6": {"logprob": -1.5, "rank": 2, "decoded_token": "yz"},
                   "9": {"logprob": -0.1, "rank": 1, "decoded_token": "q"},
                   "3": {"logprob": -4.0, "rank": 3, "decoded_token": "w"}}]
    part = t.prompt([5, 6], rows, lambda tid: f"<{tid}>")
    assert part == {"text_offset": [0, 3], "token_logprobs": [None, -1.5], "tokens": ["<5>", "yz"],
                    "top_logprobs": [None, {"yz": -1.5, "q": -0.1}]}
    assert t.completion(P_PART)["text_offset"] == [5]


class _Gen:
    def __init__(self, deltas: list[Delta], delay: float = 0.0, fail: bool = False) -> None:
        self.deltas, self.delay, self.fail = deltas, delay, fail
        self.token_ids: list[int] = [t for d in deltas for t in d.token_ids]
        self.started_at: float | None = None
        self.closed = False

    async def run(self):
        self.started_at = asyncio.get_running_loop().time()
        try:
            for d in self.deltas:
                await asyncio.sleep(self.delay)
                if self.fail:
                    raise RouterError(502, "boom")
                yield d
        finally:
            self.closed = True


def _choice(i: int, prompt: int, gen: Any, n_prompt: int = 3) -> Choice:
    return Choice(i, prompt, gen, list(range(n_prompt)), "")


def test_merged_starts_followers_after_the_leaders_first_delta_and_keeps_indexes():
    async def main():
        lead = _Gen([Delta("a", [1]), Delta("b", [2], "length")], delay=0.05)
        follow = _Gen([Delta("c", [1]), Delta("d", [2], "length")])
        other = _Gen([Delta("x", [7], "stop")])
        cs = [_choice(0, 0, lead), _choice(1, 0, follow), _choice(2, 1, other, 5)]
        t0 = asyncio.get_running_loop().time()
        got = [(c.index, d.text) async for c, d in merged(cs)]
        assert sorted(got) == [(0, "a"), (0, "b"), (1, "c"), (1, "d"), (2, "x")]
        assert follow.started_at - t0 >= 0.04 and other.started_at - t0 < 0.04  # own prompt's leader: at once
        assert sum_usage(cs) == (3 + 5, 5)
    asyncio.run(main())


def test_merged_raises_the_first_error_and_closes_every_run():
    async def main():
        slow = _Gen([Delta("a", [1])] * 50, delay=0.02)
        bad = _Gen([Delta("z", [1])], delay=0.03, fail=True)
        with pytest.raises(RouterError):
            async for _ in merged([_choice(0, 0, slow), _choice(1, 1, bad)]):
                pass
        assert slow.closed and bad.closed
    asyncio.run(main())


def test_parse_new_fields():
    r = parse_completion({"prompt": ["a", [5, 6]], "n": 2, "logprobs": 3, "echo": True, "seed": 1})
    assert r.prompts == ["a", [5, 6]] and r.n == 2 and r.echo
    assert r.sampling["logprobs"] == 3 and r.sampling["prompt_logprobs"] == 3  # echo scores the prompt
    c = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True})
    assert c.logprobs == 0 and c.sampling["logprobs"] == 0
    s = parse_chat({"messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}})
    assert s.constrained and "response_format" in s.sampling
    assert not parse_chat({"messages": [{"role": "user", "content": "x"}],
                           "response_format": {"type": "text"}}).constrained
    t = parse_chat({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}],
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})
    assert t.constrained and t.messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert choice_seed(5, 2) == 7 and choice_seed(2 ** 63 - 1, 1) == 2 ** 63 - 1


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "n": 16385, "temperature": 1}, None), ({"prompt": "a", "n": 2, "temperature": 0}, None),
    ({"prompt": "a", "n": 0}, None), ({"prompt": "a", "top_k": -2}, None), ({"prompt": "a", "min_p": 2}, None),
    ({"prompt": "a", "presence_penalty": 3}, None), ({"prompt": "a", "min_tokens": -1}, None),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"), ({"prompt": "a", "logprob_token_ids": [5]}, "logprob_token_ids"),
    ({"prompt": "a", "echo": True, "max_tokens": 0, "logprobs": 1, "logprob_token_ids": [5]}, "logprob_token_ids"),
    ({"prompt": "a", "suffix": "b"}, "suffix"), ({"prompt": "a", "guided_json": {}}, "guided_json"),
    ({"prompt": "a", "structured_outputs": {"json": {}, "regex": "x"}}, "structured_outputs"),
    ({"prompt": "a", "structured_outputs": {}}, "structured_outputs"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "xml"}}, "response_format"),
    # as vLLM 0.32 (the conformance suite's full tier found the router serving them)
    ({"prompt": "a", "stop": ""}, None), ({"prompt": "a", "stop": ["x", ""]}, None),
    ({"prompt": "a", "stream": True, "prompt_logprobs": 5}, "prompt_logprobs"),
])
def test_parse_completion_refuses(body, param):
    with pytest.raises(RouterError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


def test_parse_completion_takes_what_vllm_takes():
    """Issue 41: n up to vLLM's VLLM_MAX_N_SEQUENCES with sampling (whatever the number of prompts), and echo with
    max_tokens 0 (prompt scoring: one token generated and hidden)."""
    r = parse_completion({"prompt": ["a"] * 100, "n": 2, "temperature": 0.5})
    assert r.n == 2 and len(r.prompts) == 100
    assert parse_completion({"prompt": "a", "n": 16384, "temperature": 1}).n == 16384
    scored = parse_completion({"prompt": "a", "echo": True, "max_tokens": 0, "logprobs": 1})
    assert scored.score_only and scored.max_tokens == 1 and scored.sampling["prompt_logprobs"] == 1
    assert not parse_completion({"prompt": "a", "echo": True, "max_tokens": 3}).score_only
    # seeded random sampling: D samples every token (one random stream, as one worker); greedy keeps P's token
    assert parse_completion({"prompt": "a", "seed": 1, "temperature": 0.5}).constrained
    assert parse_completion({"prompt": "a", "seed": 1}).constrained  # vLLM's default temperature samples
    assert not parse_completion({"prompt": "a", "seed": 1, "temperature": 0}).constrained
    assert not parse_completion({"prompt": "a", "temperature": 0.5}).constrained


def test_streamed_prompt_logprobs_0_is_served_as_vllm_serves_it():
    assert parse_completion({"prompt": "a", "stream": True, "prompt_logprobs": 0}).prompt_logprobs == 0


@pytest.mark.parametrize("extra,param", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "maybe"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"stop": ""}, None), ({"stream": True, "prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_parse_chat_refuses(extra, param):
    with pytest.raises(RouterError) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], **extra})
    assert e.value.status == 400 and e.value.param == param


def test_tool_choice_needing_a_parser_is_400_without_one():
    from pdserve.router.api.tools import ToolSupport

    tools = [{"type": "function", "function": {"name": "f"}}]
    support = ToolSupport("", tokenizer=None, model_name="m")
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        req = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice})
        with pytest.raises(RouterError) as e:
            support.prepare(req, [])
        assert e.value.status == 400 and "--tool-call-parser" in e.value.message
    none = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "none"})
    assert support.prepare(none, []) is None and none.tools[0]["function"] == {
        "name": "f", "description": None, "parameters": None}  # as vLLM renders it
