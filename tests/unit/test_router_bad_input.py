"""Bad input at the router: deep JSON nesting, oversized bodies, prompts too long to tokenize, unexpected errors.

Each case runs against the real app from ``create_app`` (fake workers, the light tokenizer of
test_router_app); every refusal must be an OpenAI-shaped JSON error, never a stack trace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.router.__main__ import config_from_args
from pdserve.router.api.limits import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    MIN_CHARS_PER_TOKEN,
    load_json,
    nesting_exceeds,
)
from pdserve.router.api.tokenizer import PromptTokenizer
from pdserve.router.config import RouterConfig, RouterConfigError
from pdserve.router.errors import RouterError
from tests.unit.test_router_app import MAX_LEN, Env, FakeWorker, LightTokenizer, model_dir, run  # noqa: F401

DEEP = 5000


class CountingTokenizer(LightTokenizer):
    """The light tokenizer, counting the calls that cost CPU (tokenizing, rendering the chat template)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, *args, **kw):
        self.calls += 1
        return super().apply_chat_template(*args, **kw)


class BrokenTokenizer(LightTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError("tokenizer exploded")


@pytest.fixture()
def counting(model_dir) -> CountingTokenizer:
    return CountingTokenizer(model_dir)


def _nested_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _nested_array(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _assert_error(status: int, body, want_status: int) -> dict:
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert "Traceback" not in err["message"] and 'File "' not in err["message"]
    return err


def _chat(content: str = "hello") -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


# ---------------------------------------------------------------- nesting

@pytest.mark.parametrize("path,raw", [
    ("/v1/chat/completions", _nested_object(DEEP)),
    ("/v1/chat/completions", _nested_array(DEEP)),
    ("/v1/completions", _nested_object(DEEP)),
    ("/v1/completions", _nested_array(DEEP)),
    ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":' + _nested_array(DEEP) + "}]}"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"tools":' + _nested_object(DEEP) + "}"),
    ("/v1/completions", '{"prompt":' + _nested_array(DEEP) + "}"),
    ("/v1/completions", '{"prompt":"hi","stop":' + _nested_array(MAX_JSON_DEPTH + 5) + "}"),  # parses, too deep
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":'
     + _nested_object(MAX_JSON_DEPTH + 5) + "}"),
    ("/v1/pdserve/workers", _nested_object(DEEP)),
])
def test_deep_nesting_is_400_json(model_dir, counting, path, raw):
    w = FakeWorker("W")

    async def main():
        async with Env(model_dir, PromptTokenizer(str(model_dir), tokenizer=counting), colocated=[w]) as env:
            st, body = await env.post(path, raw, headers={"Content-Type": "application/json"})
            err = _assert_error(st, body, 400)
            assert err["type"] == "BadRequestError"  # vLLM's type for a 400
            if path != "/v1/pdserve/workers":
                assert err["code"] == "json_too_deep" and str(MAX_JSON_DEPTH) in err["message"]
            assert counting.calls == 0 and w.requests == []
            st, out = await env.post("/v1/chat/completions", _chat())  # the router is fine afterwards
            assert st == 200, out
    run(main())


def test_nesting_check_is_iterative_and_exact():
    deep: list = []
    node = deep
    for _ in range(DEEP * 4):  # far past the interpreter's recursion limit
        node.append([])
        node = node[0]
    assert nesting_exceeds(deep)
    ok: dict = {"a": [1, 2, {"b": []}]}  # depth 4
    assert not nesting_exceeds(ok, 4) and nesting_exceeds(ok, 3)
    assert not nesting_exceeds([0] * 100_000, 1) and not nesting_exceeds("[[[", 0)
    assert load_json(json.dumps({"text": "[{" * 500}).encode()) == {"text": "[{" * 500}  # brackets in strings
    assert load_json(_nested_array(MAX_JSON_DEPTH).encode()) and load_json(b"5") == 5
    with pytest.raises(RouterError, match="deeper than"):
        load_json(_nested_array(MAX_JSON_DEPTH + 1).encode())


# ---------------------------------------------------------------- body size

def test_body_over_limit_is_413_and_flag_raises_it(model_dir, counting):
    w = FakeWorker("W")
    limit = 8192
    big = json.dumps(_chat("hello " * 2000))  # ~12 KB
    assert limit < len(big) < 4 * limit

    async def main():
        tok = PromptTokenizer(str(model_dir), tokenizer=counting)
        async with Env(model_dir, tok, colocated=[w], max_body_bytes=limit) as env:
            st, body = await env.post("/v1/chat/completions", big)
            err = _assert_error(st, body, 413)
            assert err["code"] == "request_too_large" and str(limit) in err["message"]
            assert "--max-body-bytes" in err["message"]

            async def chunks():  # no Content-Length: the cap applies while reading
                for i in range(0, len(big), 1000):
                    yield big[i:i + 1000].encode()

            async with env.session.post(env.url + "/v1/completions", data=chunks()) as r:
                assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
            st, body = await env.post("/v1/pdserve/workers", json.dumps({"url": "x" * limit}))
            _assert_error(st, body, 413)
            st, out = await env.post("/v1/chat/completions", _chat())
            assert st == 200, out
        async with Env(model_dir, tok, colocated=[w], max_body_bytes=4 * limit) as env:
            st, body = await env.post("/v1/chat/completions", big)
            assert st != 413, body  # through the body limit (the prompt itself is then too long: 400)
            assert _assert_error(st, body, 400)["code"] == "context_length_exceeded"
    run(main())


def test_default_limit_is_4_mib(model_dir, counting):
    w = FakeWorker("W")

    async def main():
        async with Env(model_dir, PromptTokenizer(str(model_dir), tokenizer=counting), colocated=[w]) as env:
            st, body = await env.post("/v1/completions", json.dumps({"prompt": "a" * (DEFAULT_MAX_BODY_BYTES + 10)}))
            assert _assert_error(st, body, 413)["code"] == "request_too_large"
            assert counting.calls == 0
    run(main())


def test_max_body_bytes_flag_and_validation(model_dir):
    base = ["--model-dir", str(model_dir), "--colocated", "http://127.0.0.1:9"]
    assert config_from_args(base).max_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 << 20
    assert config_from_args(base + ["--max-body-bytes", str(16 << 20)]).max_body_bytes == 16 << 20
    for bad in (0, -1, 100, 2 << 30):
        with pytest.raises(RouterConfigError, match="--max-body-bytes.*byte count"):
            RouterConfig(model_dir=str(model_dir), colocated=("http://127.0.0.1:9",), max_body_bytes=bad)


# ---------------------------------------------------------------- prompt length before tokenizing

@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a" * (MAX_LEN * MIN_CHARS_PER_TOKEN + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["hello " * 10 ** 5]}, "prompt"),
    ("/v1/chat/completions", _chat("the " * 10 ** 5), "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "a" * (MAX_LEN * 8)},
                                           {"role": "user", "content": [{"type": "text", "text": "b" * MAX_LEN * 9}]}]},
     "messages"),
])
def test_too_long_prompt_is_400_before_tokenizing(model_dir, counting, path, body, param):
    w = FakeWorker("W")

    async def main():
        async with Env(model_dir, PromptTokenizer(str(model_dir), tokenizer=counting), colocated=[w]) as env:
            st, out = await env.post(path, body)
            err = _assert_error(st, out, 400)
            assert err["code"] == "context_length_exceeded" and err["param"] == param
            assert f"maximum context length is {MAX_LEN} tokens" in err["message"]
            assert counting.calls == 0 and w.requests == []
            # just under the bound the prompt is tokenized, and refused by its token count
            st, out = await env.post("/v1/completions", {"prompt": "a " * (MAX_LEN * MIN_CHARS_PER_TOKEN // 2)})
            assert _assert_error(st, out, 400)["code"] == "context_length_exceeded" and counting.calls == 1
            assert "tokens" in out["error"]["message"]
    run(main())


def test_char_bound_uses_longest_token(model_dir):
    class LongTokens(LightTokenizer):
        def __init__(self, d: Path) -> None:
            super().__init__(d)
            self.tok.add_tokens([" " * 40])

    tok = PromptTokenizer(str(model_dir), tokenizer=LongTokens(model_dir))
    assert tok.chars_per_token == 40
    assert PromptTokenizer(str(model_dir), tokenizer=LightTokenizer(model_dir)).chars_per_token < MIN_CHARS_PER_TOKEN


# ---------------------------------------------------------------- normal requests, unexpected errors

def test_normal_requests_still_work(model_dir, counting):
    w = FakeWorker("W")

    async def main():
        async with Env(model_dir, PromptTokenizer(str(model_dir), tokenizer=counting), colocated=[w]) as env:
            st, out = await env.post("/v1/chat/completions", _chat("the cat sat"))
            assert st == 200 and out["object"] == "chat.completion", out
            st, out = await env.post("/v1/completions", {"prompt": "the cat", "max_tokens": 2,
                                                         "chat_template_kwargs": {"a": {"b": {"c": [1, [2]]}}}})
            assert st == 200 and out["usage"]["completion_tokens"] == 2, out
            assert counting.calls == 3  # chat: template + encode; completion: encode
    run(main())


def test_unexpected_exception_is_json_500_without_traceback(model_dir):
    w = FakeWorker("W")

    async def main():
        tok = PromptTokenizer(str(model_dir), tokenizer=BrokenTokenizer(model_dir))
        async with Env(model_dir, tok, colocated=[w]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "the cat", "max_tokens": 2})
            err = _assert_error(st, out, 500)
            assert err["type"] == "server_error" and "tokenizer exploded" in err["message"]
    run(main())
