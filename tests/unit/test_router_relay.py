"""The pass-through path (pdserve.router.run.relay) against a fake worker that writes vLLM's exact streamed bytes: the
client gets the same bytes as through the per-token path, and migration, deadlines and a client leaving still work
while events are relayed."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.router.api.protocol import parse_completion
from pdserve.router.api.response import ResponseBuilder
from pdserve.router.run import relay as relay_mod
from pdserve.router.run.relay import plain_event
from pdserve.router.workers import reader_tap
from pdserve.router.workers.reader_tap import open_taps
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

TRICKY = {15: ' "q"\n', 16: " é\u2028\x01\\", 17: " \t</s>\x7f", 18: "", 19: " 😀/"}


def vllm_chunk(index: int, text: str, finish: str | None, stop_reason: Any, prompt_ids: list[int] | None,
               token_ids: list[int] | None) -> bytes:
    """One streamed completion event as vLLM 0.32 writes it (``CompletionStreamResponse.model_dump_json(
    exclude_unset=True)`` with every choice field set, in its field order)."""
    from pydantic import BaseModel

    class Choice(BaseModel):
        index: int
        text: str
        logprobs: Any = None
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        prompt_token_ids: list[int] | None = None
        token_ids: list[int] | None = None

    class Chunk(BaseModel):
        id: str
        object: str
        created: int
        model: str
        choices: list[Choice]

    c = Chunk(id="cmpl-x1", object="text_completion", created=1700000000, model="worker-model",
              choices=[Choice(index=index, text=text, logprobs=None, finish_reason=finish, stop_reason=stop_reason,
                              prompt_token_ids=prompt_ids, token_ids=token_ids)])
    return b"data: " + c.model_dump_json(exclude_unset=True).encode() + b"\n\n"


class VllmShapedWorker(FakeWorker):
    """FakeWorker whose streams are vLLM's bytes (compact pydantic JSON, the first event with prompt_token_ids, a
    usage event, [DONE]). ``stall_after``: go silent for 5 s after that many tokens."""

    def __init__(self, name: str, stall_after: int | None = None, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.stall_after = stall_after

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return await super().completions(request)
        self.requests.append(body)
        prompt = body["prompt"]
        gen = self.continued(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = 0
        try:
            for t, piece, finish, stop_reason in gen:
                if self.die_after is not None and n == self.die_after:
                    request.transport.close()
                    return resp
                if self.stall_after is not None and n == self.stall_after:
                    await asyncio.sleep(5)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                event = vllm_chunk(0, piece, finish, stop_reason, prompt if n == 0 else None, [t])
                if getattr(self, "spaced", False):  # ordinary JSON spacing, keys reversed, non-ASCII escaped
                    event = _respaced(event[:-2], True) + b"\n\n"
                await resp.write(event)
                n += 1
            usage = {"id": "cmpl-x1", "object": "text_completion", "created": 1700000000, "model": "worker-model",
                     "choices": [], "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n,
                                              "completion_tokens": n}}
            await resp.write(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n")
            self.finished += 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()
            raise
        return resp


def _respaced(event: bytes, reverse: bool) -> bytes:
    """The same event as ordinary JSON spacing writes it (``", "``, ``": "``), its keys reversed if asked, and its
    text's non-ASCII escaped (``\\uXXXX``): what another engine or vLLM release may send."""
    obj = json.loads(event[len(b"data: "):])
    if reverse:
        obj = dict(reversed(obj.items()))
        obj["choices"] = [dict(reversed(c.items())) for c in obj.get("choices", [])]
    return b"data: " + json.dumps(obj).encode()


def test_plain_event_is_the_builders_text_chunk_byte_for_byte():
    """vLLM's bytes, re-spaced JSON and reversed keys all give the builder's chunk, byte for byte."""
    for chat in (False, True):
        for rti in (False, True):
            body: dict[str, Any] = {"prompt": "a", "stream": True, "return_token_ids": rti}
            req = parse_completion(body)
            if chat:
                req.kind = "chat"
            b = ResponseBuilder(req, "tiny")
            for index in (0, 3):
                head, tail = b.relay_parts(index)
                for text in [*TRICKY.values(), "plain", '","logprobs":null,"finish_reason":null']:
                    for ids in ([7], [7, 8, 9], []):
                        event = vllm_chunk(0, text, None, None, None, ids)[:-2]
                        for form in (event, _respaced(event, False), _respaced(event, True)):
                            got = plain_event(form)
                            assert got is not None, (text, form)
                            raw_text, got_ids = got
                            assert json.loads(raw_text) == text and got_ids == ids
                            spliced = head + raw_text + tail + (json.dumps(ids).replace(" ", "").encode() if rti
                                                                else b"") + b"}]}\n\n"
                            assert spliced == b.text_chunk(text, ids, index)


def test_events_that_are_not_plain_go_the_full_path():
    not_plain = [
        vllm_chunk(0, "x", "length", None, None, [7]),  # a finish
        vllm_chunk(0, "x", None, None, [1, 2], [7]),  # the first event: prompt ids
        vllm_chunk(1, "x", None, None, None, [7]),  # another choice
        vllm_chunk(0, "x", None, None, None, None),  # no token ids
        b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens"'
        b':1,"total_tokens":2,"completion_tokens":1}}\n\n',
        b'data: {"error":{"message":"boom"}}\n\n',
        b"data: [DONE]\n\n",
        b": keep-alive\n\n",
        vllm_chunk(0, "x", None, None, None, [7]).replace(b'"logprobs":null', b'"logprobs":{"tokens":["x"]}'),
        vllm_chunk(0, "x", None, None, None, [7]).replace(b"]}]}", b']}],"kv_transfer_params":{}}'),
        vllm_chunk(0, "x", None, None, None, [7]).replace(b"[7]", b"[7,,8]"),
        vllm_chunk(0, "x", None, None, None, [7]).replace(b"[7]", b"[-7]"),
        vllm_chunk(0, "x", None, None, None, [7]).replace(b'"text":"x"', b'"text":7'),
        vllm_chunk(0, "x", None, None, None, [7]).replace(b'"index":0', b'"index":0,"extra":1'),
        vllm_chunk(0, "x", None, None, None, [7]).replace(b'"choices":[{', b'"choices":[{"index":0,"text":"y",'
                                                          b'"token_ids":[1]},{'),  # two choices
    ]
    for ev in not_plain:
        assert plain_event(ev[:-2]) is None, ev
        if ev.startswith(b"data: {") and b",," not in ev:  # valid JSON: not plain whatever its spacing and order
            assert plain_event(_respaced(ev[:-2], True)) is None, ev


def _normalized(chunks: list[str]) -> list[str]:
    out = []
    for c in chunks:
        c = re.sub(r'"id":"[^"]*"', '"id":"ID"', c)
        c = re.sub(r'"created":\d+', '"created":0', c)
        c = re.sub(r'"pdserve_timings":\{[^}]*\}', '"pdserve_timings":{}', c)
        out.append(c)
    return out


def _count_relays(monkeypatch, entered: list[int] | None = None) -> list[int]:
    """Wrap Relay.run: the tokens of every relayed stretch that returned (``entered``: one entry per start)."""
    stretches: list[int] = []
    real = relay_mod.Relay.run

    async def counted(self, *a: Any) -> int:
        if entered is not None:
            entered.append(1)
        n = await real(self, *a)
        stretches.append(n)
        return n

    monkeypatch.setattr(relay_mod.Relay, "run", counted)
    return stretches


def _count_inline(monkeypatch) -> list[int]:
    """Wrap Relay.feed and Relay.ended: one entry per read relayed from the socket callback (1) or stream end
    or failure met there (0)."""
    calls: list[int] = []
    feed, ended = relay_mod.Relay.feed, relay_mod.Relay.ended

    def fed(self, data: bytes) -> bytes:
        calls.append(1)
        return feed(self, data)

    def was_ended(self) -> bytes:
        calls.append(0)
        return ended(self)

    monkeypatch.setattr(relay_mod.Relay, "feed", fed)
    monkeypatch.setattr(relay_mod.Relay, "ended", was_ended)
    return calls


@pytest.mark.parametrize("endpoint,worker_json,tap", [
    ("/v1/completions", "vllm", True), ("/v1/chat/completions", "vllm", True),
    ("/v1/completions", "spaced", True),  # another engine's spacing and key order: relayed all the same
    ("/v1/completions", "vllm", False),  # the inline tap off (reader_tap's check failed): relayed from the task
])
def test_relayed_stream_equals_the_per_token_path(model_dir, tokenizer, monkeypatch, endpoint, worker_json, tap):
    w = VllmShapedWorker("C", texts=TRICKY, delay_s=0.002)
    w.spaced = worker_json == "spaced"
    if not tap:
        monkeypatch.setattr(reader_tap, "_checked", True)
        monkeypatch.setattr(reader_tap, "available", False)
    body: dict[str, Any] = {"max_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True}
    if endpoint == "/v1/completions":
        body["prompt"] = "a"
    else:
        body["messages"] = [{"role": "user", "content": "a"}]
    stretches = _count_relays(monkeypatch)
    inline = _count_inline(monkeypatch)

    async def main() -> tuple[list[str], list[str]]:
        async with Env(model_dir, tokenizer, colocated=[w]) as env:
            st, relayed = await env.stream(endpoint, body, headers={"X-Pdserve-Timings": "1"})
            assert st == 200
            monkeypatch.setattr(relay_mod, "plain_event", lambda ev: None)  # every event the full path
            st, full = await env.stream(endpoint, body, headers={"X-Pdserve-Timings": "1"})
            assert st == 200
            return relayed, full

    relayed, full = run(main())
    timings = json.loads(relayed[-1])["pdserve_timings"]
    assert sum(stretches) == timings["relayed_tokens"] == 14  # all but the first event and the finish
    assert json.loads(relayed[-1])["usage"]["completion_tokens"] == 16
    assert _normalized(relayed) == _normalized(full)
    if tap:
        assert inline.count(1) >= 5  # most reads relayed from the socket callback
    else:
        assert inline == []
    assert not open_taps()
    text = "".join((json.loads(c)["choices"] or [{}])[0].get("text") or
                   ((json.loads(c)["choices"] or [{}])[0].get("delta") or {}).get("content") or "" for c in relayed)
    assert ' "q"\n' in text and "😀" in text


def test_worker_dies_while_relaying_the_request_migrates(model_dir, tokenizer, monkeypatch):
    a, b = VllmShapedWorker("A", die_after=4, delay_s=0.01), VllmShapedWorker("B")
    stretches = _count_relays(monkeypatch)
    inline = _count_inline(monkeypatch)

    async def main() -> None:
        async with Env(model_dir, tokenizer, colocated=[a, b], policy="round_robin") as env:
            st, chunks = await env.stream("/v1/completions", {"prompt": "a", "max_tokens": 10, "stream": True,
                                                              "stream_options": {"include_usage": True}})
            assert st == 200 and not any("error" in json.loads(c) for c in chunks)
            text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks if json.loads(c)["choices"])
            assert text == " b c w15 w16 w17 w18 w19 w20 w21 w22"
            assert json.loads(chunks[-1])["usage"]["completion_tokens"] == 10
            assert b.requests[-1]["prompt"][-4:] == [13, 14, 15, 16] and b.requests[-1]["max_tokens"] == 6
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_migrations_total{role="colocated"} 1.0' in metrics

    run(main())
    assert stretches and stretches[0] == 3  # tokens 2-4 relayed, then A's stream broke
    assert 0 in inline and not open_taps()  # the break met inline


def test_deadline_while_relaying(model_dir, tokenizer, monkeypatch):
    w = VllmShapedWorker("C", stall_after=3, delay_s=0.01)
    stretches = _count_relays(monkeypatch)
    inline = _count_inline(monkeypatch)

    async def main() -> None:
        async with Env(model_dir, tokenizer, colocated=[w], request_timeout_s=0.8) as env:
            st, chunks = await env.stream("/v1/completions", {"prompt": "a", "max_tokens": 8, "stream": True})
            assert st == 200
            err = json.loads(chunks[-1])
            assert err["error"]["code"] == "request_timeout"
            await asyncio.wait_for(w.aborted.wait(), 5)  # the worker's stream closed: vLLM frees its KV
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_deadline_exceeded_total{deadline="request"} 1.0' in metrics

    run(main())
    assert stretches == [2] and inline.count(1) >= 1 and not open_taps()


def test_client_leaving_while_relaying_closes_the_worker_stream(model_dir, tokenizer, monkeypatch):
    w = VllmShapedWorker("C", delay_s=0.05)
    entered: list[int] = []
    stretches = _count_relays(monkeypatch, entered)

    async def main() -> None:
        async with Env(model_dir, tokenizer, colocated=[w]) as env:
            async with aiohttp.ClientSession() as s:
                async with s.post(env.url + "/v1/completions",
                                  json={"prompt": "a", "max_tokens": 40, "stream": True}) as r:
                    got = b""
                    while got.count(b"\n\n") < 4:
                        got += await r.content.readany()
            await asyncio.wait_for(w.aborted.wait(), 5)
            assert w.finished == 0

    run(main())
    assert entered == [1] and stretches == []  # the client left while the relay ran
    assert not open_taps()


def test_slow_client_gets_every_byte(model_dir, tokenizer, monkeypatch):
    """Past 64 KiB unsent to the client the relay stops writing from the socket callback and waits for the client;
    nothing is lost or reordered."""
    big = {t: f" {t}" + "x" * 300000 for t in range(5, 100)}  # 12 MB: more than the sockets buffer
    w = VllmShapedWorker("C", texts=big)
    stretches = _count_relays(monkeypatch)
    drains: list[int] = []
    drained = asyncio.Event()
    real_drain = web.StreamResponse.drain

    async def drain(self: web.StreamResponse) -> None:
        drains.append(1)
        drained.set()
        await real_drain(self)

    monkeypatch.setattr(web.StreamResponse, "drain", drain)

    async def main() -> None:
        async with Env(model_dir, tokenizer, colocated=[w]) as env:
            async with aiohttp.ClientSession() as s:
                async with s.post(env.url + "/v1/completions",
                                  json={"prompt": "a", "max_tokens": 40, "stream": True}) as r:
                    first = await r.content.readany()
                    # read no more until the router's writes have backed up and it waits for us (not a fixed
                    # sleep: how fast a loaded machine fills the sockets is not this test's business)
                    await asyncio.wait_for(drained.wait(), 60)
                    raw = (first + await r.read()).decode()
            events = [e[len("data: "):] for e in raw.split("\n\n") if e]
            assert events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            want = "".join(big[5 + (12 - 4 + k) % 95] for k in range(40))
            assert text == want

    run(main())
    assert sum(stretches) == 38 and drains  # it did wait for the client


def test_pd_stream_is_relayed_once_ds_text_settles(model_dir, tokenizer, monkeypatch):
    """P -> D: the router's detokenizer makes the text of D's first events only; once two agree with it (.textsync)
    D's plain events pass through as bytes, and the client gets what the per-token path gives, byte for byte."""
    p, d = VllmShapedWorker("P"), VllmShapedWorker("D", delay_s=0.002)
    body: dict[str, Any] = {"prompt": "a", "max_tokens": 16, "stream": True, "return_token_ids": True,
                            "stream_options": {"include_usage": True}}
    stretches = _count_relays(monkeypatch)

    async def main() -> tuple[list[str], list[str]]:
        async with Env(model_dir, tokenizer, prefill=[p], decode=[d]) as env:
            st, relayed = await env.stream("/v1/completions", body, headers={"X-Pdserve-Timings": "1"})
            assert st == 200
            monkeypatch.setattr(relay_mod, "plain_event", lambda ev: None)  # every event the full path
            st, full = await env.stream("/v1/completions", body, headers={"X-Pdserve-Timings": "1"})
            assert st == 200
            return relayed, full

    relayed, full = run(main())
    timings = json.loads(relayed[-1])["pdserve_timings"]
    # t1 from P, D's first two events checked against the router's detokenizer, D's finish the full path
    assert sum(stretches) == timings["relayed_tokens"] == 12
    assert json.loads(relayed[-1])["usage"]["completion_tokens"] == 16
    assert _normalized(relayed) == _normalized(full)
    text = "".join(json.loads(c)["choices"][0]["text"] for c in relayed if json.loads(c)["choices"])
    assert text == " b c" + "".join(f" w{i}" for i in range(15, 29))
    # D continued after P's token: the early request (the prompt alone, P's token from P's answer to D) or serial
    last = d.requests[-1]
    assert (last["prompt"][-1] == 13 or last["kv_transfer_params"].get("pdserve_continue") is True) and not open_taps()


def test_pd_stream_whose_text_never_agrees_keeps_the_routers_text(model_dir, tokenizer, monkeypatch):
    """A D whose own text is not one worker's (here: the fake's texts are not its tokenizer's) never settles: every
    token keeps the router's detokenized text and nothing is relayed."""
    wrong = {t: f" x{t}" for t in range(5, 100)}
    p, d = VllmShapedWorker("P", texts=wrong), VllmShapedWorker("D", texts=wrong)
    stretches = _count_relays(monkeypatch)

    async def main() -> list[str]:
        async with Env(model_dir, tokenizer, prefill=[p], decode=[d]) as env:
            st, chunks = await env.stream("/v1/completions", {"prompt": "a", "max_tokens": 16, "stream": True})
            assert st == 200
            return chunks

    chunks = run(main())
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks)
    assert text == " b c" + "".join(f" w{i}" for i in range(15, 29))  # the tokenizer's text, not the fake's
    assert stretches == []


def test_the_tap_check_turns_the_inline_path_off_with_a_log_line(monkeypatch, caplog):
    """reader_tap.check: passes on the installed aiohttp; on an aiohttp it does not know (here: a 4.x version
    string) it leaves the tap off and says so once, and no stream may be tapped."""
    async def main() -> tuple[bool, bool, bool]:
        monkeypatch.setattr(reader_tap, "_checked", False)
        ok = reader_tap.check()
        monkeypatch.setattr(reader_tap, "_checked", False)
        monkeypatch.setattr(reader_tap.aiohttp, "__version__", "4.0.0")
        off = reader_tap.check()
        reader = aiohttp.StreamReader(reader_tap._Protocol(), 1 << 16, loop=asyncio.get_running_loop())
        return ok, off, reader_tap.can_tap(reader)

    with caplog.at_level("WARNING", logger="pdserve.router"):
        ok, off, can = run(main())
    assert ok and not off and not can
    assert [r.getMessage() for r in caplog.records if "inline tap is off" in r.getMessage()] == [
        "the relay's inline tap is off (aiohttp 4.0.0 is not a 3.x release); relays read from their task instead "
        "(slower)"]
