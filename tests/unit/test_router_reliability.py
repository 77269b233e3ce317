"""Issue 14 on the router side, against fake workers: a slow worker is not a dead one, survivors serve whole
requests, in-flight requests migrate (prompt + tokens streamed so far) with text, stop strings, usage and the
conductor's progress right across it, deadlines, and in-flight limits (429 + Retry-After) for every policy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from pdserve.conductor import Conductor, ConductorConfig
from pdserve.router.app import ROUTER_KEY
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.workers.client import Probe, Wait, WorkerError
from tests.unit.test_conductor_policy import PROMPT as C_PROMPT
from tests.unit.test_conductor_policy import Clock, cost, req
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)
from tests.unit.test_router_ticket import PROMPT, FakeClient, drain, generation, make

UNDISTURBED = " b c w15 w16 w17 w18 w19 w20 w21 w22"  # the fake model's 10 tokens after "a"


# ---------------------------------------------------------------- a slow worker is not a dead one

def test_probe_failures_take_a_worker_out_only_over_a_window():
    clock = Clock()
    r = WorkerRegistry([("prefill", "http://p"), ("decode", "http://d")], probe_failures=3, probe_window_s=10.0,
                       clock=clock)
    slow = Probe(False, "no answer within 2.0 s")
    for _ in range(5):  # five timeouts within 4 s: busy, not dead
        assert r.report_probe("http://p", slow) is False
        clock.t += 1.0
    assert r["http://p"].healthy and r["http://p"].last_error.startswith("slow: no answer within 2.0 s")
    clock.t += 5.0  # the run of failures now spans 10 s
    assert r.report_probe("http://p", slow) is True and not r["http://p"].healthy
    assert r["http://p"].last_error.startswith("6 probes failed over 10.0 s")
    assert r.report_probe("http://p", Probe(True, "HTTP 200")) is True and r["http://p"].healthy
    assert r.report_probe("http://p", slow) is False  # a good probe started the count again
    assert r.report_probe("http://d", Probe(False, "unreachable: refused", dead=True)) is True  # at once
    assert not r["http://d"].healthy
    assert r.report_probe("http://d", Probe(False, "HTTP 503", dead=True)) is False
    assert r.mark_dead("http://p", "refused") is True and not r["http://p"].healthy


class SlowToAccept(FakeClient):
    """P0 never accepts within the connect timeout (busy), without any evidence that it is gone."""

    async def complete(self, url: str, body: dict, wait: Wait) -> dict:
        if url == "http://p0":
            self.calls.append(("complete", url))
            raise WorkerError(url, "connect", "no connection within 5.0 s")
        return await super().complete(url, body, wait)


def test_connect_timeout_moves_the_request_but_keeps_the_worker():
    pl, _, _, closed = make("round_robin")
    client = SlowToAccept()
    deltas = asyncio.run(drain(generation(pl, client)))
    assert deltas[-1].finish_reason == "length"
    assert [c[1] for c in client.calls if c[0] == "complete"] == ["http://p0", "http://p1"]
    assert pl.registry["http://p0"].healthy and pl.conductor.workers["http://p0"].healthy
    # the only prefill worker slow: served whole by a decode worker, nobody marked down
    pl, _, _, _ = make("round_robin", members=(("prefill", "http://p0"), ("decode", "http://d0")))
    client = SlowToAccept()
    deltas = asyncio.run(drain(generation(pl, client)))
    assert [d.token_ids for d in deltas] == [[10], [11], [12], [13]]
    assert client.calls == [("complete", "http://p0"), ("stream", "http://d0")] and pl.registry["http://p0"].healthy


# ---------------------------------------------------------------- migration (hand-off level)

class Recording(FakeClient):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.bodies: list[tuple[str, str, dict]] = []

    async def complete(self, url: str, body: dict, wait: Wait) -> dict:
        self.bodies.append(("complete", url, body))
        return await super().complete(url, body, wait)

    def stream(self, url: str, body: dict, wait: Wait) -> AsyncIterator[dict]:
        self.bodies.append(("stream", url, body))
        return super().stream(url, body, wait)


def test_migration_sends_prompt_plus_streamed_tokens_and_progress_counts_per_ticket():
    pl, _, _, closed = make("round_robin")
    progress: list[tuple[str, int]] = []
    real = pl.conductor.decode_progress
    pl.conductor.decode_progress = lambda rid, n: (progress.append((rid, n)), real(rid, n))[1]  # type: ignore
    client = Recording(break_after={"http://d0": 2})
    gen = generation(pl, client, max_tokens=6)
    deltas = asyncio.run(drain(gen))
    assert [d.token_ids for d in deltas] == [[7], [10], [11], [7], [10], [11]]
    assert deltas[-1].finish_reason == "length" and gen.token_ids == [7, 10, 11, 7, 10, 11]
    calls = [(k, u, b["prompt"][len(PROMPT):], b["max_tokens"]) for k, u, b in client.bodies]
    assert calls == [("complete", "http://p0", [], 1), ("stream", "http://d0", [7], 5),
                     ("complete", "http://p1", [7, 10, 11], 1), ("stream", "http://d1", [7, 10, 11, 7], 2)]
    assert [n for _, n in progress] == [1, 2, 3, 1, 2, 3]  # each ticket hears its own tokens
    assert gen.migrations == 1 and len(closed) == 2 and pl.conductor.in_flight() == 0


def test_migration_when_decode_regenerates_the_first_token():
    pl, _, _, closed = make("round_robin")
    client = Recording(break_after={"http://d0": 2})
    gen = generation(pl, client, max_tokens=4)
    gen.first_from_prefill = False
    deltas = asyncio.run(drain(gen))
    assert [d.token_ids for d in deltas] == [[10], [11], [10], [11]]
    streams = [(u, b["prompt"][len(PROMPT):], b["max_tokens"]) for k, u, b in client.bodies if k == "stream"]
    assert streams == [("http://d0", [], 4), ("http://d1", [10, 11], 2)]
    assert len(closed) == 2


def test_a_migrated_seeded_request_skips_the_draws_already_made():
    """Seeded random sampling (D samples every token): the attempt after a migration asks its worker to skip as
    many draws of the request's seeded stream as tokens were output (pdserve/vllm/rng_skip.py); the first asks none,
    and the client's own vllm_xargs stay."""
    pl, _, _, _ = make("round_robin")
    client = Recording(break_after={"http://d0": 2})
    gen = generation(pl, client, max_tokens=4)
    gen.first_from_prefill = False
    gen.req.sampling = {**gen.req.sampling, "seed": 5, "temperature": 1.0, "vllm_xargs": {"mine": 1}}
    asyncio.run(drain(gen))
    streams = [(u, b["vllm_xargs"]) for k, u, b in client.bodies if k == "stream"]
    assert streams == [("http://d0", {"mine": 1}), ("http://d1", {"mine": 1, "pdserve_rng_skip": 2})]
    greedy = generation(make("round_robin")[0], Recording(break_after={"http://d0": 2}), max_tokens=4)
    greedy.req.sampling = {**greedy.req.sampling, "seed": 5, "temperature": 0.0}
    greedy._done = 2
    assert "vllm_xargs" not in greedy._body([1], 2, True)  # greedy: no random stream to continue


# ---------------------------------------------------------------- migration through the router

class DropsPrefill(FakeWorker):
    """Takes its non-streamed (prefill) calls and drops the connection before answering: died before t1."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            self.requests.append(body)
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return await super().completions(request)


def _text(chunks: list[str]) -> str:
    return "".join(json.loads(c)["choices"][0]["text"] for c in chunks if json.loads(c).get("choices"))


def test_decode_dies_mid_stream_output_equals_undisturbed_run(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D", die_after=3)

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, chunks = await env.stream("/v1/completions", {"prompt": "a", "max_tokens": 10, "stream": True,
                                                              "stream_options": {"include_usage": True}})
            assert st == 200 and not any("error" in json.loads(c) for c in chunks)
            assert _text(chunks) == UNDISTURBED
            assert json.loads(chunks[-1])["usage"]["completion_tokens"] == 10
            # P took over: the prompt plus t1 and D's three tokens, six tokens left, decoded on P alone
            assert p.requests[-1]["prompt"][-4:] == [13, 14, 15, 16] and p.requests[-1]["max_tokens"] == 6
            assert "kv_transfer_params" not in p.requests[-1]
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 10})
            assert st == 200 and out["choices"][0]["text"] == UNDISTURBED
            assert out["usage"]["completion_tokens"] == 10
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_migrations_total{role="decode"} 2.0' in metrics
            assert env.app[ROUTER_KEY].registry[d.url].healthy  # a dropped stream is no proof D is gone
    run(main())


def test_stop_string_spanning_a_migration(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D", die_after=3)

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            # "w16" came from D, " w17" comes from P after the move
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 10, "stop": ["w16 w17"]})
            assert st == 200 and out["choices"][0]["text"] == " b c w15 "
            assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 5
            assert "stop" not in p.requests[-1]  # the router matches stop strings on the whole text
    run(main())


def test_prefill_dies_before_its_first_token_is_placed_again(model_dir, tokenizer):
    p1, p2, d = DropsPrefill("P1"), FakeWorker("P2"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p1, p2], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 10})
            assert st == 200 and out["choices"][0]["text"] == UNDISTURBED
            assert len(p1.requests) == 1 and len(p2.requests) == 1
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_migrations_total{role="prefill"} 1.0' in metrics
    run(main())


# ---------------------------------------------------------------- deadlines

def test_request_deadline_before_and_after_the_first_token(model_dir, tokenizer):
    p, d = FakeWorker("P", prefill_delay_s=5), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], request_timeout_s=0.5) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 4})
            assert st == 504 and out["error"]["code"] == "request_timeout" and "0.5 s" in out["error"]["message"]
            await asyncio.wait_for(p.aborted.wait(), 5)  # P's call closed: vLLM aborts it, frees its KV
        p2, d2 = FakeWorker("P"), FakeWorker("D", delay_s=5)
        async with Env(model_dir, tokenizer, [p2], [d2], request_timeout_s=0.8) as env:
            st, chunks = await env.stream("/v1/completions", {"prompt": "a", "max_tokens": 4, "stream": True})
            assert st == 200 and json.loads(chunks[0])["choices"][0]["text"] == " b"
            err = json.loads(chunks[-1])
            assert err["error"]["code"] == "request_timeout" and err["error"]["type"] == "timeout_error"
            await asyncio.wait_for(d2.aborted.wait(), 5)
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_deadline_exceeded_total{deadline="request"} 1.0' in metrics
    run(main())


def test_handoff_deadline(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D", delay_s=5)  # D takes the decode and sends nothing for 5 s

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], handoff_timeout_s=0.3) as env:
            st, chunks = await env.stream("/v1/completions", {"prompt": "a", "max_tokens": 4, "stream": True})
            assert st == 200 and json.loads(chunks[0])["choices"][0]["text"] == " b"
            err = json.loads(chunks[-1])
            assert err["error"]["code"] == "handoff_timeout" and "0.3 s" in err["error"]["message"]
            await asyncio.wait_for(d.aborted.wait(), 5)
    run(main())


# ---------------------------------------------------------------- overload

@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "conductor"])
def test_per_worker_inflight_limit_for_every_policy(policy):
    c = Conductor(ConductorConfig(policy=policy, block_size=16, max_inflight_per_worker=1, local_prefill_tokens=0),
                  cost(), Clock())
    for w, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        c.add_worker(w, role, 100_000)
    a, b = c.place(req("a", C_PROMPT)), c.place(req("b", C_PROMPT))
    assert {a.prefill, b.prefill} == {"p0", "p1"} and {a.decode, b.decode} == {"d0", "d1"}
    r = c.place(req("c", C_PROMPT))
    assert r.kind == "reject" and r.code == "worker_limit" and r.retry_after_s >= 1
    c.finished("a")
    assert c.place(req("d", C_PROMPT)).kind in ("disaggregated", "local")


def test_inflight_limits_answer_429_with_retry_after(model_dir, tokenizer):
    p, d = FakeWorker("P", prefill_delay_s=0.5), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], max_inflight=1) as env:
            first = asyncio.create_task(env.post("/v1/completions", {"prompt": "a", "max_tokens": 2}))
            await asyncio.sleep(0.2)
            async with env.session.post(env.url + "/v1/completions", json={"prompt": "a"}) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == "max_inflight"
            assert (await first)[0] == 200
            assert (await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2}))[0] == 200
        p2 = FakeWorker("P", prefill_delay_s=0.5)
        async with Env(model_dir, tokenizer, [p2], [FakeWorker("D")], max_inflight_per_worker=1) as env:
            first = asyncio.create_task(env.post("/v1/completions", {"prompt": "a", "max_tokens": 2}))
            await asyncio.sleep(0.2)
            async with env.session.post(env.url + "/v1/completions", json={"prompt": "a"}) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["code"] == "worker_limit"
            assert (await first)[0] == 200
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_requests_total{endpoint="completions",status="429"} 1.0' in metrics
    run(main())


def test_ready_degraded_and_back(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            await d.stop()  # refused from now on
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 10})
            assert st == 200 and out["choices"][0]["text"] == UNDISTURBED  # D refused: P served it whole
            st, body = await env.get("/ready")
            assert st == 200 and json.loads(body)["status"] == "degraded"
            await d.start()  # back (a new port: re-register it the way the discovery sidecar would)
            async with env.session.post(env.url + "/v1/pdserve/workers", json={"url": d.url, "role": "decode"}) as r:
                assert r.status == 201
            st, body = await env.get("/ready")
            assert st == 200 and json.loads(body)["status"] == "ready"
    run(main())


def test_worker_call_failures_are_classified_by_evidence():
    """Refused: connect + dead. Accepted then silent: timeout (not 'no connection'). Accepted then dropped: closed."""
    import aiohttp

    from pdserve.launch.procs import free_port
    from pdserve.router.workers.client import WorkerClient

    async def silent(request: web.Request) -> web.Response:
        await asyncio.sleep(0.8)
        return web.Response()

    async def drop(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    async def main():
        app = web.Application()
        app.router.add_post("/silent/v1/completions", silent)
        app.router.add_post("/drop/v1/completions", drop)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as s:
                client = WorkerClient(s, 2.0, 0.3)
                errors = {}
                for name, url in (("refused", f"http://127.0.0.1:{free_port()}"), ("silent", base + "/silent"),
                                  ("drop", base + "/drop")):
                    with pytest.raises(WorkerError) as e:
                        await client.complete(url, {"prompt": [1]}, Wait())
                    errors[name] = (e.value.kind, e.value.dead)
                assert errors == {"refused": ("connect", True), "silent": ("timeout", False),
                                  "drop": ("closed", False)}
                assert (await client.check(f"http://127.0.0.1:{free_port()}", 1.0)).dead
        finally:
            await runner.cleanup()
    run(main())
