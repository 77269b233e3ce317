"""truncate_prompt_tokens / truncation_side as one vLLM 0.32 worker serves them (api/truncation.py); the figures
the router must give were read off a vLLM 0.32 worker (tests/conformance checks them against one on every run)."""

from __future__ import annotations

import pytest

from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.api.truncation import (
    Truncation,
    check_truncation,
    parse_truncation,
    truncated_ids,
    truncated_max_tokens,
    truncated_text_ids,
)
from pdserve.router.errors import RouterError
from tests.unit.test_router_app import MAX_LEN, Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)


class WordEncoder:
    """One id per word; ``max_length`` truncates from the left as vLLM's HF tokenizer does, keeping a BOS."""

    chars_per_token = 3

    def __init__(self, bos: bool = False) -> None:
        self.bos = bos
        self.calls: list[tuple[str, int | None]] = []

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        self.calls.append((text, max_length))
        ids = [int(w) for w in text.split()]
        head = [0] if self.bos and add_special_tokens else []
        if max_length is not None:
            ids = ids[len(ids) - max(0, max_length - len(head)):]
        return head + ids


def _err(fn, *args) -> RouterError:
    with pytest.raises(RouterError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_parse_as_vllm_request_models():
    assert parse_truncation({}) is None
    assert parse_truncation({"truncation_side": "right"}) is None  # the side acts only with a size
    assert parse_truncation({"truncate_prompt_tokens": -1}) == Truncation(-1)
    assert parse_truncation({"truncate_prompt_tokens": 5, "truncation_side": "left"}) == Truncation(5, "left")
    for bad in (-2, 1.5, "3", True, 2 ** 63):
        # named as vLLM's request model (pydantic) names them
        assert _err(parse_truncation, {"truncate_prompt_tokens": bad}).param == "body.truncate_prompt_tokens"
    assert _err(parse_truncation, {"truncate_prompt_tokens": 3, "truncation_side": "middle"}).param == \
        "body.truncation_side"
    assert _err(parse_truncation, {"truncation_side": "middle"}).param == "body.truncation_side"
    assert parse_completion({"prompt": "x", "truncate_prompt_tokens": 2}).truncation == Truncation(2)
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 0,
                       "truncation_side": "right"}).truncation == Truncation(0, "right")


def test_over_the_context_is_400_naming_it():
    check_truncation(Truncation(2048), 2048)
    check_truncation(None, 2048)
    err = _err(check_truncation, Truncation(2049), 2048)
    assert err.param == "truncate_prompt_tokens"
    assert err.message == ("truncate_prompt_tokens=2049 cannot be greater than max_model_len = 2048. Please request a "
                           "smaller truncation size.")


def test_sizes_and_sides():
    ids = list(range(10))
    assert truncated_ids(ids, Truncation(3), 2048, 16) == [7, 8, 9]  # unset side: the tokenizer's, left
    assert truncated_ids(ids, Truncation(3, "left"), 2048, 16) == [7, 8, 9]
    assert truncated_ids(ids, Truncation(3, "right"), 2048, 16) == [0, 1, 2]
    assert truncated_ids(ids, Truncation(30, "right"), 2048, 16) == ids
    assert truncated_ids(ids, Truncation(0), 2048, 16) == []
    # -1: the context less one token when output is asked for, else the whole context
    assert Truncation(-1).keep(2048, 16) == 2047 and Truncation(-1).keep(2048, 0) == 2048
    assert truncated_ids(ids, Truncation(-1), 8, 4) == ids[-7:]
    assert truncated_ids(ids, Truncation(-1, "right"), 8, 0) == ids[:8]


def test_text_without_a_side_is_cut_by_the_tokenizer_keeping_its_specials():
    enc = WordEncoder(bos=True)
    text = " ".join(str(i) for i in range(1, 11))
    assert truncated_text_ids(enc, text, Truncation(4), 2048, 16, True) == [0, 8, 9, 10]
    assert enc.calls == [(text, 4)]
    assert truncated_text_ids(enc, text, Truncation(0), 2048, 16, True) == []


def test_text_with_a_side_is_cut_in_characters_then_sliced():
    enc = WordEncoder(bos=True)
    text = " ".join(str(i) for i in range(1, 10))  # 17 characters; max_model_len 2 x 3 characters = 6
    assert truncated_text_ids(enc, text, Truncation(2, "right"), 2, 0, True) == [0, 1]
    assert enc.calls[-1] == (text[:6], None)
    assert truncated_text_ids(enc, text, Truncation(2, "left"), 2, 0, True) == [8, 9]
    assert enc.calls[-1] == (text[-6:], None)


def test_budget_clamps_to_the_room_left():
    assert truncated_max_tokens(2000, 100, 2048) == 48
    assert truncated_max_tokens(3, None, 2048) == 2045
    assert truncated_max_tokens(2047, 16, 2048) == 1
    err = _err(truncated_max_tokens, 2048, 1, 2048)
    assert (err.param, err.message) == ("max_tokens", "max_tokens must be at least 1, got 0.")
    err = _err(truncated_max_tokens, 0, 5, 2048)
    assert (err.param, err.message) == (None, "The decoder prompt cannot be empty")


def test_workers_get_the_truncated_prompt(model_dir, tokenizer):  # noqa: F811
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, prefill=[p], decode=[d]) as env:
            body = {"prompt": "hello world the cat sat", "max_tokens": 3, "truncate_prompt_tokens": 2,
                    "truncation_side": "right"}
            st, out = await env.post("/v1/completions", body)
            assert st == 200, out
            assert out["usage"]["prompt_tokens"] == 2
            assert p.requests[-1]["prompt"] == tokenizer.encode("hello world")
            assert d.requests[-1]["prompt"][:2] == tokenizer.encode("hello world")
            st, out = await env.post("/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 3,
                                                         "truncate_prompt_tokens": 3})
            assert st == 200 and out["usage"]["prompt_tokens"] == 3 and p.requests[-1]["prompt"] == [7, 8, 9]
            # a prompt over the context is served truncated, its budget clamped as vLLM does
            st, out = await env.post("/v1/completions", {"prompt": [5] * (MAX_LEN + 10), "max_tokens": 16,
                                                         "truncate_prompt_tokens": -1})
            assert st == 200 and out["usage"] == {"prompt_tokens": MAX_LEN - 1, "completion_tokens": 1,
                                                  "total_tokens": MAX_LEN}, out
            chat = {"messages": [{"role": "user", "content": "cat " * (MAX_LEN * 10)}], "max_tokens": 2,
                    "truncate_prompt_tokens": 5, "truncation_side": "left"}
            st, out = await env.post("/v1/chat/completions", chat)
            assert st == 200 and out["usage"]["prompt_tokens"] == 5, out
            for body, param in (({"prompt": "hello", "truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens"),
                                ({"prompt": "hello", "truncate_prompt_tokens": 0}, None),
                                ({"prompt": [5] * 80, "truncate_prompt_tokens": MAX_LEN}, "max_tokens")):
                st, out = await env.post("/v1/completions", body)
                assert st == 400 and out["error"]["param"] == param, (body, out)
    run(main())
