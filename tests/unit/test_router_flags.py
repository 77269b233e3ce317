"""pdserve.router.api.lax_values: boolean fields read as vLLM 0.32's pydantic models read them (checked against a
vLLM worker: "stream": "yes", "echo": 1, "stream": 1.0 and "echo": "Yes" are served; "echo": 2 is a 400)."""

from __future__ import annotations

import pytest

from pdserve.router.api.lax_values import flag
from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.errors import RouterError


@pytest.mark.parametrize("v, want", [(True, True), (False, False), (1, True), (0, False), (1.0, True), (0.0, False),
                                     ("yes", True), ("Yes", True), ("on", True), ("t", True), ("1", True),
                                     ("no", False), ("OFF", False), ("f", False), ("0", False), ("false", False)])
def test_pydantic_lax_booleans_are_read_as_vllm_reads_them(v, want):
    assert flag({"x": v}, "x") is want


@pytest.mark.parametrize("v", [2, -1, 0.5, "maybe", "", [], {}, "true "])
def test_anything_else_is_a_400_naming_the_field(v):
    with pytest.raises(RouterError) as e:
        flag({"x": v}, "x")
    assert e.value.status == 400 and e.value.param == "x"


def test_absent_or_null_is_the_default():
    assert flag({}, "x") is False and flag({"x": None}, "x", True) is True


def test_chat_logprobs_1_and_a_string_stream_are_served():
    r = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": 1, "top_logprobs": 2,
                    "stream": "true"})
    assert r.logprobs == 2 and r.stream
    c = parse_completion({"model": "m", "prompt": "a", "echo": 1, "return_tokens_as_token_ids": "yes"})
    assert c.echo and c.sampling["return_tokens_as_token_ids"] is True
