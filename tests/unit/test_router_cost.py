"""The router's per-token shortcuts (issue 16, item 3) give exactly what the long way gives: the SSE bytes of a
plain text delta, coalesced decode progress, the SSE split, one deadline timer per request, and the client's
write time kept out of ``router_overhead_ms``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.api.response import ResponseBuilder, sse
from pdserve.router.errors import RouterError
from pdserve.router.fleet import ticket as ticket_mod
from pdserve.router.run.delta import Delta
from pdserve.router.run.generation import Timings
from pdserve.router.workers.client import Wait, _sse_data

TEXTS = ["", " hello", 'quote " and \\ back', "new\nline\ttab\r", "é 中文 🙂", "\x00\x1f\u2028\u2029", "</script>"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("return_token_ids", [False, True])
def test_text_chunk_is_byte_identical_to_the_built_chunk(kind, return_token_ids):
    body: dict[str, Any] = {"model": 'm"odel', "stream": True, "return_token_ids": return_token_ids}
    if kind == "chat":
        req = parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]})
    else:
        req = parse_completion({**body, "prompt": "hi"})
    req.request_id = 'id-"1\u00e9'
    b = ResponseBuilder(req, 'served "name" é')
    for text in TEXTS:
        for ids in ([], [5], [1, 2, 300000]):
            for index in (0, 3, 12):
                assert b.text_chunk(text, ids, index) == sse(b.chunk(text, ids, index=index)), (text, ids, index)


def test_sse_data_fast_path_matches_the_general_split():
    for event in (b"data: {\"a\":1}", b"data:{\"a\":1}", b"data: x\r\ndata: y", b"data: a\ndata: b", b": comment",
                  b"event: e\ndata: z", b"data: [DONE]", b"data:  two spaces", b""):
        general = [ln[5:].lstrip(b" ") for ln in event.replace(b"\r\n", b"\n").split(b"\n")
                   if ln.startswith(b"data:")]
        assert _sse_data(event) == (b"\n".join(general) if general else None), event


class _Conductor:
    def __init__(self) -> None:
        self.progress: list[int] = []
        self.finished_ids: list[str] = []

    def decode_progress(self, rid: str, n: int) -> None:
        self.progress.append(n)

    def finished(self, rid: str) -> None:
        self.finished_ids.append(rid)

    def recalibrate(self, d: object, ttft_s: float | None, tpot_s: float | None) -> None:
        self.measured = (ttft_s, tpot_s)


def _ticket(cond: _Conductor) -> ticket_mod.PlacementTicket:
    t = ticket_mod.PlacementTicket.__new__(ticket_mod.PlacementTicket)
    t._conductor = cond  # type: ignore[assignment]
    t.request_id = "r"
    t.closed = False
    t._prefilled = False
    t.tokens_before = 0
    t._pending = t._reported = 0
    t._reported_at = 0.0
    t._clock, t._placed_at = (lambda: 0.0), 0.0  # the placement's own timing (prediction error): unused here
    t._first = t._last = None
    t.decision = None  # type: ignore[assignment]  (only handed to the fake conductor's recalibrate)
    return t


def test_progress_is_coalesced_and_flushed_at_close():
    cond = _Conductor()
    t = _ticket(cond)
    every = ticket_mod.PROGRESS_EVERY_TOKENS
    for n in range(1, 2 * every + 6):
        t.progress(n, now=0.0)  # no time passes: only the token count triggers a report
    assert cond.progress == [1, 2, 2 + every, 2 + 2 * every]
    t.close()
    assert cond.progress[-1] == 2 * every + 5 and cond.finished_ids == ["r"]
    t.progress(100, now=9.0)
    t.close()
    assert cond.progress[-1] == 2 * every + 5 and cond.finished_ids == ["r"]  # nothing after the close


def test_progress_reports_when_time_passes_and_counts_per_ticket():
    cond = _Conductor()
    t = _ticket(cond)
    t.tokens_before = 10  # a migrated request: this ticket's own tokens only
    t.progress(10, now=0.0)
    t.progress(11, now=0.0)
    t.progress(12, now=0.0)
    t.progress(13, now=0.01)
    t.progress(14, now=0.01 + ticket_mod.PROGRESS_EVERY_S)
    assert cond.progress == [1, 2, 4]
    t.close()
    assert cond.progress == [1, 2, 4]  # nothing pending


def test_client_wait_is_not_router_overhead():
    t = Timings(arrive=0.0, end=1.0, wait=Wait(0.6), client=Wait(0.3))
    r = t.report()
    assert r["client_wait_ms"] == pytest.approx(300.0) and r["router_overhead_ms"] == pytest.approx(100.0)


def test_one_deadline_timer_per_request_cancels_a_silent_stream():
    """The request's deadline is one loop timer: a worker silent past it is cut with the 504 code, and the timer
    scheduled once however many tokens came before."""
    from pdserve.router.api.protocol import parse_completion
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.run.generation import Generation, GenerationOptions
    from tests.unit.test_router_ticket import PROMPT, FakeClient, make

    g = Generation(parse_completion({"prompt": PROMPT, "max_tokens": 30}), PROMPT, 30, make()[0],
                   FakeClient(), RouterMetrics(), Timings(arrive=__import__("time").perf_counter()),  # type: ignore[arg-type]
                   "disaggregated", options=GenerationOptions(request_timeout_s=0.2))
    closed: list[bool] = []

    async def worker() -> AsyncGenerator[Delta, None]:
        try:
            for i in range(20):
                yield Delta("x", [i])
            await asyncio.sleep(30)  # silent
            yield Delta("never", [0])
        finally:
            closed.append(True)

    async def go() -> tuple[int, RouterError, int]:
        calls = 0
        loop = asyncio.get_running_loop()
        real = loop.call_at

        def counting(*a: Any, **k: Any) -> Any:
            nonlocal calls
            calls += 1
            return real(*a, **k)

        loop.call_at = counting  # type: ignore[method-assign]
        g.deadline.arm()  # what Generation.run does first
        gen = worker()
        got = 0
        try:
            while True:
                await g._next(gen)
                got += 1
        except RouterError as e:
            await gen.aclose()
            return got, e, calls

    got, err, timers = asyncio.run(go())
    assert got == 20 and err.status == 504 and err.code == "request_timeout" and closed == [True]
    assert timers <= 2  # the deadline's one timer (asyncio.sleep's own is the other), not one per token
    with pytest.raises(RouterError):
        asyncio.run(g._next(worker()))  # expired: the next await fails at once


def test_stream_idle_timeout_without_a_timer_per_chunk():
    """A worker silent mid-body fails the stream with kind "timeout" after the idle timeout; a router busy longer
    than that between reads (the data already there) does not; aiohttp's per-chunk sock_read timer is off."""
    import json

    import aiohttp
    from aiohttp import web

    from pdserve.router.workers.client import WorkerClient, WorkerError

    event = b"data: " + json.dumps({"choices": [{"text": "x", "token_ids": [1]}]}).encode() + b"\n\n"

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(3):
            await resp.write(event)
            await asyncio.sleep(0.01)
        if request.query.get("mode") == "silent":
            await asyncio.sleep(1.5)  # silent (short: the server's cleanup waits for this handler)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    class Q(WorkerClient):
        mode = "ok"

        async def _post(self, url: str, path: str, body: dict, headers=None) -> aiohttp.ClientResponse:
            return await super()._post(url, path + "?mode=" + self.mode, body, headers)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                client = Q(session, 2.0, 0.3)
                got = []
                async for obj in client.stream(url, {}, Wait()):
                    got.append(obj)
                    await asyncio.sleep(0.4)  # busy past the idle timeout: not the worker's silence
                assert len(got) == 3
                client.mode = "silent"
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(WorkerError) as e:
                    _ = [x async for x in client.stream(url, {}, Wait())]
                assert e.value.kind == "timeout" and 0.25 < loop.time() - t0 < 1.2
        finally:
            await runner.cleanup()

    asyncio.run(main())
