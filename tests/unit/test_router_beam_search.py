"""run/beam_search.py: which bodies take the beam search path (``use_beam_search`` as vLLM's model reads it), and
the relay of the whole request to one worker (fake workers on real sockets; real vLLM: tests/conformance and
test_pd_router.py)."""

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from pdserve.router.errors import RouterError
from pdserve.router.run.beam_search import BeamSearch, wants_beam_search
from pdserve.router.workers.client import WorkerClient


@pytest.mark.parametrize("value,beam", [(True, True), ("true", True), (1, True), ("yes", True), ("maybe", True),
                                        (False, False), (None, False), (0, False), ("false", False), ("No", False)])
def test_use_beam_search_values(value, beam):
    assert wants_beam_search({"prompt": "a", "use_beam_search": value}) is beam


def test_absent_or_not_an_object():
    assert not wants_beam_search({"prompt": "a"})
    assert not wants_beam_search(["use_beam_search"])


# ---- the relay: BeamSearch against fake workers on real sockets ----

BEAMS = {"choices": [{"index": i, "text": t, "token_ids": [i]} for i, t in enumerate(("a", "b", "c"))]}


class Placed:
    """A placement that hands out the given workers in order, recording what it was asked."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.asked: list[tuple[int, frozenset[str], bool]] = []
        self.closed = 0
        self.dead: list[str] = []
        self.registry = SimpleNamespace(mark_dead=lambda url, why: self.dead.append(url))

    def choose(self, ids, exclude, request_id, max_tokens, domain=0, whole=False):
        self.asked.append((len(ids), exclude, whole))
        url = next(u for u in self.urls if u not in exclude)
        return SimpleNamespace(decode=SimpleNamespace(url=url), prefill_done=lambda: None,
                               close=lambda: setattr(self, "closed", self.closed + 1))


async def _worker(slow_s: float = 0.0) -> tuple[web.AppRunner, str, list[dict]]:
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        await asyncio.sleep(slow_s)
        if body.get("stream"):
            return web.json_response({"error": {"message": "Streaming is not currently supported with beam search",
                                                "type": "BadRequestError", "param": None, "code": 400}}, status=400)
        return web.json_response(BEAMS)

    async def chat(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for piece in (b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n', b"data: [DONE]\n\n"):
            await out.write(piece)
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", bodies


async def _ask(beam: BeamSearch, kind: str, body: dict) -> tuple[int, str, bytes]:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await beam.answer(request, kind, body)
        except RouterError as e:
            return web.json_response(e.to_dict(), status=e.status)

    app = web.Application()
    app.router.add_post("/", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/", json={}) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()
    finally:
        await runner.cleanup()


def _beam(urls: list[str], session: aiohttp.ClientSession, timeout_s: float | None = None
          ) -> tuple[BeamSearch, Placed]:
    placed = Placed(urls)
    client = WorkerClient(session, connect_timeout_s=2.0, idle_timeout_s=0.2)  # beam search waits past idle

    async def ids(kind: str, body: dict) -> list[int]:
        return [1, 2, 3]

    return BeamSearch(placed, lambda: client, ids, timeout_s), placed  # type: ignore[arg-type]


def test_the_workers_answer_is_relayed_as_it_is():
    async def main():
        runner, url, bodies = await _worker(slow_s=0.5)  # longer than the idle timeout: vLLM is silent till done
        try:
            async with aiohttp.ClientSession() as session:
                beam, placed = _beam([url], session)
                body = {"prompt": "hi", "n": 3, "use_beam_search": True, "temperature": 0}
                status, ctype, raw = await _ask(beam, "completions", body)
                assert (status, json.loads(raw)) == (200, BEAMS) and ctype.startswith("application/json")
                assert bodies == [body] and placed.asked == [(3, frozenset(), True)] and placed.closed == 1
                status, _, raw = await _ask(beam, "completions", {**body, "stream": True})
                assert status == 400 and "beam search" in json.loads(raw)["error"]["message"]  # vLLM's refusal
                status, ctype, raw = await _ask(beam, "chat", {"messages": [], "stream": True,
                                                               "use_beam_search": True})
                assert status == 200 and ctype.startswith("text/event-stream") and raw.endswith(b"data: [DONE]\n\n")
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_worker_that_refuses_the_connection_is_left_out():
    async def main():
        runner, url, bodies = await _worker()
        gone = "http://127.0.0.1:1"  # nothing listens there
        try:
            async with aiohttp.ClientSession() as session:
                beam, placed = _beam([gone, url], session)
                status, _, raw = await _ask(beam, "completions", {"prompt": "hi", "use_beam_search": True})
                assert status == 200 and json.loads(raw) == BEAMS
                assert placed.dead == [gone] and [a[1] for a in placed.asked] == [frozenset(), {gone}]
                assert placed.closed == 2  # every ticket closed
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_request_deadline_and_the_routers_own_fields():
    async def main():
        runner, url, _ = await _worker(slow_s=2.0)
        try:
            async with aiohttp.ClientSession() as session:
                beam, placed = _beam([url], session, timeout_s=0.3)
                status, _, raw = await _ask(beam, "completions", {"prompt": "hi", "use_beam_search": True})
                assert status == 504 and json.loads(raw)["error"]["code"] == "request_timeout"
                assert placed.closed == 1
                status, _, raw = await _ask(beam, "completions", {"prompt": "hi", "use_beam_search": True,
                                                                  "kv_transfer_params": {"do_remote_decode": True}})
                assert status == 400 and json.loads(raw)["error"]["param"] == "kv_transfer_params"
        finally:
            await runner.cleanup()

    asyncio.run(main())
