"""The runner against a small fake OpenAI streaming server (in-process aiohttp): open-loop timing, closed-loop
concurrency, turn order within sessions, and the time bound."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from aiohttp import web

from pdserve.bench.metrics import summarize
from pdserve.bench.runner import RunOptions, run_workload
from pdserve.bench.workload import Session, Turn, Workload


class FakeServer:
    """Streams ``max_tokens`` chunks ``gap_s`` apart after ``ttft_s``; records arrivals and concurrency."""

    def __init__(self, ttft_s: float = 0.02, gap_s: float = 0.01) -> None:
        self.ttft_s, self.gap_s = ttft_s, gap_s
        self.arrivals: list[tuple[float, list[int]]] = []
        self.inflight = self.max_inflight = 0
        self.bodies: list[dict] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append((time.monotonic(), body["prompt"]))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(self.ttft_s)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(self.gap_s)
                await resp.write(f"data: {json.dumps({'choices': [{'text': 't'}]})}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                              "completion_tokens": body["max_tokens"]}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        finally:
            self.inflight -= 1
        return resp


@pytest.fixture
def server():
    fake = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def _wl(arrivals, tokens=3, concurrency=None, turns=1):
    return Workload("w", [Session(i, a, [Turn([1000 + i, k], tokens) for k in range(turns)])
                          for i, a in enumerate(arrivals)], concurrency)


def _opts(server, **kw):
    return RunOptions(url=server.url, model="m", progress=False, warmup=0, **kw)


def test_open_loop_follows_arrival_times(server):
    res = asyncio.run(run_workload(_wl([0.0, 0.3, 0.6]), _opts(server)))
    sent = [t for t, _ in server.arrivals]
    assert [round(b - sent[0], 1) for b in sent] == [0.0, 0.3, 0.6]
    s = summarize(res.records, res.wall_s)
    assert s["errors"] == 0 and s["requests"] == 3
    assert 15 <= s["ttft_p50_ms"] < 100 and 8 <= s["tpot_p50_ms"] < 60
    assert all(r.output_tokens == 3 and len(r.chunk_times) == 3 for r in res.records)
    assert server.bodies[0]["stream"] is True and server.bodies[0]["pdserve_timings"] is True


def test_closed_loop_bounds_concurrency(server):
    res = asyncio.run(run_workload(_wl([0.0] * 8, tokens=5, concurrency=2), _opts(server)))
    assert len(res.records) == 8 and server.max_inflight == 2


def test_turns_run_in_order(server):
    asyncio.run(run_workload(_wl([0.0, 0.0], turns=3), _opts(server)))
    by_session: dict[int, list[int]] = {}
    for _, prompt in server.arrivals:
        by_session.setdefault(prompt[0], []).append(prompt[1])
    assert by_session == {1000: [0, 1, 2], 1001: [0, 1, 2]}


def test_time_bound_stops_sending_and_counts_the_rest(server):
    server.gap_s = 0.05
    res = asyncio.run(run_workload(_wl([0.0, 0.1, 5.0, 6.0], tokens=4), _opts(server, duration_s=0.5, drain_s=5)))
    assert len(server.arrivals) == 2 and len(res.records) == 2 and res.truncated == 2
    assert res.wall_s < 2


def test_max_requests_and_drain_cancel(server):
    server.gap_s = 1.0
    res = asyncio.run(run_workload(_wl([0.0, 0.0, 0.0], tokens=5), _opts(server, max_requests=2, duration_s=0.2,
                                                                        drain_s=0.2)))
    assert len(res.records) == 2 and all(not r.ok and "time bound" in r.error for r in res.records)
    assert res.truncated == 1
