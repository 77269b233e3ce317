"""A worker's refusal (a 4xx answer, or vLLM's error event with a 4xx ``code``) is the client's refusal, on every
attempt of the run (issue 42): vLLM's status, type, message, ``param`` and ``code``, no worker address, no Python
repr; never a retry or a migration; after output, the stream ends with vLLM's error event."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from pdserve.router.errors import RouterError
from pdserve.router.run.failures import Migrate, Retry, classify
from pdserve.router.workers.client import WorkerError
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

W = "http://10.1.2.3:8000"
VLLM_ERROR = {"error": {"message": "structured_outputs.json_object must be True if set", "type": "BadRequestError",
                        "param": None, "code": 400}}


@pytest.mark.parametrize("status", [400, 404, 413, 422])
@pytest.mark.parametrize("role,started,mid", [("prefill", False, False), ("decode", False, True),
                                              ("decode", True, True), ("colocated", True, True)])
def test_a_refusal_is_the_clients_on_every_attempt(status, role, started, mid):
    err = {"error": {**VLLM_ERROR["error"], "code": status, "param": "structured_outputs"}}
    for e in (WorkerError(W, "http", f"HTTP {status}", status, err), WorkerError(W, "stream_error", str(err), None, err)):
        out = classify(e, role, started, mid)
        assert isinstance(out, RouterError), out
        assert out.status == status and out.to_dict() == err  # vLLM's own, field for field
        assert out.event == (e.kind == "stream_error")
        assert W not in out.message and "{'" not in out.message


@pytest.mark.parametrize("kind,status,want", [
    ("connect", None, Retry), ("closed", None, Migrate), ("timeout", None, Migrate), ("http", 500, Migrate),
    ("http", 503, Migrate), ("stream_error", 500, Migrate), ("stream_error", None, Migrate)])
def test_a_workers_own_failure_is_not_a_refusal(kind, status, want):
    payload = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": status}}
    e = WorkerError(W, kind, "x", status if kind == "http" else None, payload)
    assert isinstance(classify(e, "decode", False, False), want)


class RefusingWorker(FakeWorker):
    """A FakeWorker whose streams refuse after ``after`` tokens with vLLM's error event (200, the event,
    [DONE]), as vLLM refuses in its engine (a grammar, a token id); unstreamed calls are served."""

    def __init__(self, name: str, after: int = 0, error: dict[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.after = after
        self.error = error or VLLM_ERROR

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return await super().completions(_Replay(request, body))
        self.requests.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        gen = self.generate(body["prompt"], body.get("max_tokens", 16), [], True)
        for _, (t, piece, _, _) in zip(range(self.after), gen):
            chunk = {"id": "c", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": piece, "token_ids": [t], "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps(self.error).encode() + b"\n\ndata: [DONE]\n\n")
        return resp


class _Replay:
    """The request again for FakeWorker.completions, its body already read."""

    def __init__(self, request: web.Request, body: dict) -> None:
        self._request, self._body = request, body

    async def json(self) -> dict:
        return self._body

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


BODY = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 6, "temperature": 0}


def test_d_refuses_after_ps_token(model_dir, tokenizer):  # noqa: F811
    """P's token is out when D refuses: unstreamed, vLLM's 400 as it is; streamed, P's token, then vLLM's event;
    D is asked once (no retry, no migration) and P once."""
    p, d = FakeWorker("P"), RefusingWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], migration_limit=3) as env:
            st, out = await env.post("/v1/completions", BODY)
            assert (st, out) == (400, VLLM_ERROR)
            assert len(p.requests) == 1 and len(d.requests) == 1
            st, chunks = await env.stream("/v1/completions", {**BODY, "stream": True})
            objs = [json.loads(c) for c in chunks]
            assert st == 200 and objs[-1] == VLLM_ERROR and objs[0]["choices"][0]["text"] == " on"
            assert len(p.requests) == 2 and len(d.requests) == 2
            _, metrics = await env.get("/metrics")
            assert "pdserve_router_migrations_total{" not in metrics
    run(main())


def test_a_refusal_before_any_output_streams_as_vllms(model_dir, tokenizer):  # noqa: F811
    """D produces every token (structured outputs) and refuses in its stream before the first: a streamed client
    gets vLLM's stream (200, the event, [DONE]), an unstreamed one vLLM's 400."""
    p, d = FakeWorker("P"), RefusingWorker("D")
    body = {**BODY, "structured_outputs": {"regex": "[a-z]+"}}

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, chunks = await env.stream("/v1/completions", {**body, "stream": True})
            assert st == 200 and [json.loads(c) for c in chunks] == [VLLM_ERROR]
            st, out = await env.post("/v1/completions", body)
            assert (st, out) == (400, VLLM_ERROR)
            assert len(d.requests) == 2 and "structured_outputs" not in p.requests[0]
    run(main())


def test_p_refuses(model_dir, tokenizer):  # noqa: F811
    """P's 422 is the client's, as P wrote it, streamed or not; D is never asked."""
    p, d = FakeWorker("P", status=422), FakeWorker("D")
    want = {"error": {"message": "fake error from P", "type": "BadRequestError", "param": None, "code": 422}}

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            assert await env.post("/v1/completions", BODY) == (422, want)
            assert await env.post("/v1/completions", {**BODY, "stream": True}) == (422, want)
            assert len(p.requests) == 2 and d.requests == []
    run(main())


def test_a_migrated_attempt_that_is_refused_ends_the_stream(model_dir, tokenizer):  # noqa: F811
    """D dies after two tokens; the request migrates to P (decode-local), which refuses: vLLM's event ends the
    stream, and nothing migrates again."""
    p, d = RefusingWorker("P"), FakeWorker("D", die_after=2)

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], upstream_idle_timeout_s=5, migration_limit=3) as env:
            st, chunks = await env.stream("/v1/completions", {**BODY, "stream": True})
            objs = [json.loads(c) for c in chunks]
            assert st == 200 and objs[-1] == VLLM_ERROR
            assert "".join(o["choices"][0]["text"] for o in objs[:-1]) == " on mat a"  # t1 + D's two
            assert len(p.requests) == 2 and len(d.requests) == 1  # P's prefill, P's migrated stream
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_migrations_total{role="decode"} 1.0' in metrics
    run(main())


@pytest.mark.parametrize("body", [{"prompt": "a", "max_tokens": 4, "min_tokens": 5},
                                  {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 4,
                                   "min_tokens": 5}])
def test_min_tokens_over_max_tokens_is_refused_as_vllm_does(body):
    """P and D each get a share of both fields, which alone never breaks vLLM's rule: the router checks it."""
    from pdserve.router.api.protocol import parse_chat, parse_completion

    with pytest.raises(RouterError) as e:
        (parse_chat if "messages" in body else parse_completion)(body)
    assert e.value.status == 400 and e.value.type == "BadRequestError"
    assert e.value.message == "min_tokens must be less than or equal to max_tokens=4, got 5."
    (parse_chat if "messages" in body else parse_completion)({**body, "min_tokens": 4})


def test_an_id_out_of_the_vocabulary_is_refused_in_the_stream_as_vllm_does(model_dir, tokenizer):  # noqa: F811
    """vLLM checks token ids in its engine, inside the stream: streamed, 200 + the error event (code 400); not
    streamed, the 400. Negative logit_bias keys are ids out of the vocabulary too. No worker is asked."""
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            for extra in ({"logit_bias": {"99999999": 1}}, {"logit_bias": {"-1": 1}}, {"prompt": [99999999]},
                          {"allowed_token_ids": [99999999]}, {"stop_token_ids": [99999999]}):
                st, out = await env.post("/v1/completions", {**BODY, **extra})
                assert st == 400 and out["error"]["type"] == "BadRequestError" and out["error"]["code"] == 400
                st, chunks = await env.stream("/v1/completions", {**BODY, **extra, "stream": True})
                assert st == 200 and [json.loads(c) for c in chunks] == [out], extra
            assert p.requests == [] and d.requests == []
    run(main())
