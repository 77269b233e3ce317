"""The placement ticket: one owner of a request's placement lifecycle (prefill done, progress, decode failover,
close exactly once), alone and driven by the hand-off on its success and error paths."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
from pdserve.router.api.protocol import parse_completion
from pdserve.router.errors import RouterError
from pdserve.router.fleet.placement import ConductorPlacement
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.metrics import RouterMetrics
from pdserve.router.run.generation import Generation, Timings
from pdserve.router.workers.client import Wait, WorkerError

from .fake_clock import Clock


class RecordingCost(OnlineCostModel):
    """The real online cost model, recording what it is told."""

    def __init__(self) -> None:
        super().__init__(1000)
        self.prefills: list[tuple[int, int, float]] = []
        self.handoffs: list[float] = []

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        self.prefills.append((new_tokens, cached_tokens, seconds))
        super().observe_prefill(new_tokens, cached_tokens, seconds)

    def observe_handoff(self, seconds: float, alpha: float = 0.2) -> None:
        self.handoffs.append(seconds)
        super().observe_handoff(seconds, alpha)


def make(policy: str = "conductor", members: tuple[tuple[str, str], ...] = (
        ("prefill", "http://p0"), ("prefill", "http://p1"), ("decode", "http://d0"), ("decode", "http://d1"))
         ) -> tuple[ConductorPlacement, RecordingCost, Clock, list[str]]:
    clock, cost = Clock(), RecordingCost()
    conductor = Conductor(ConductorConfig(policy=policy, block_size=4, local_prefill_tokens=0), cost, clock)
    closed: list[str] = []
    finished = conductor.finished

    def spy(request_id: str) -> None:
        closed.append(request_id)
        finished(request_id)

    conductor.finished = spy  # type: ignore[method-assign]
    return ConductorPlacement(conductor, WorkerRegistry(members)), cost, clock, closed


PROMPT = list(range(1, 41))


@pytest.mark.parametrize("policy", ["conductor", "round_robin", "least_loaded"])
def test_decode_failover_replaces_only_decode(policy):
    pl, cost, clock, closed = make(policy)
    c = pl.conductor
    t = pl.choose(PROMPT, request_id="r1", max_tokens=8)
    p, d = t.prefill, t.decode
    assert p is not None and t.decision.kind == "disaggregated"
    clock.t += 0.25
    t.prefill_done()
    t.progress(1)  # t1 from P
    assert len(cost.prefills) == 1 and cost.prefills[0][2] == pytest.approx(0.25)
    counts, queue_p = dict(c.counts), c.workers[p.url].queued_prefill_tokens()
    clock.t += 0.5  # D refused the connection meanwhile
    new_d = t.replace_decode(frozenset({d.url}))
    assert new_d.url != d.url and t.decode is new_d and t.prefill is p  # same P, another D
    assert c.counts == counts  # no second placement decision
    assert c.workers[p.url].queued_prefill_tokens() == queue_p and "r1" not in c.workers[p.url].prefills
    assert "r1" not in c.workers[d.url].decodes and "r1" in c.workers[new_d.url].decodes
    t.prefill_done()  # a repeat is ignored: still the one prefill observation, no ~0 s one
    assert len(cost.prefills) == 1
    clock.t += 0.01
    t.progress(2)  # new D's first token: the failed D's wait is not a hand-off time
    assert cost.handoffs == []
    t.close()
    assert closed == ["r1"] and c.in_flight() == 0
    assert all(not w.decodes and not w.prefills for w in c.workers.values())


def test_decode_failover_without_another_decode_worker_is_503_and_keeps_the_reservation():
    pl, _, _, closed = make(members=(("prefill", "http://p0"), ("decode", "http://d0")))
    t = pl.choose(PROMPT, request_id="r1")
    t.prefill_done()
    with pytest.raises(RouterError) as e:
        t.replace_decode(frozenset({"http://d0"}))
    assert e.value.status == 503 and e.value.code == "no_healthy_worker"
    assert "r1" in pl.conductor.workers["http://d0"].decodes  # released by close, not lost
    t.close()
    assert closed == ["r1"] and not pl.conductor.workers["http://d0"].decodes


def test_decode_failover_skips_unhealthy_decode_workers():
    pl, _, _, _ = make(members=(("prefill", "http://p0"), ("decode", "http://d0"), ("decode", "http://d1"),
                                ("decode", "http://d2")))
    t = pl.choose(PROMPT, request_id="r1")
    others = sorted({"http://d0", "http://d1", "http://d2"} - {t.decode.url})
    pl.registry.set_health(others[0], False, "probe failed")
    assert t.replace_decode(frozenset({t.decode.url})).url == others[1]


def test_close_exactly_once_and_reports_after_close_are_ignored():
    pl, cost, clock, closed = make()
    t = pl.choose(PROMPT, request_id="r1")
    t.close()
    t.close()
    assert closed == ["r1"] and t.closed
    clock.t += 1.0
    t.prefill_done()
    t.progress(3)
    assert cost.prefills == [] and pl.conductor.in_flight() == 0
    with pytest.raises(RuntimeError):
        t.replace_decode()


# ---------------------------------------------------------------- driven by the hand-off


class FakeClient:
    """Worker calls without HTTP: ``refuse`` never accept (connect error), ``break_after`` fail mid-stream
    after that many chunks."""

    def __init__(self, refuse: set[str] = frozenset(), break_after: dict[str, int] | None = None,
                 clock: Clock | None = None) -> None:
        self.refuse = set(refuse)
        self.break_after = break_after or {}
        self.clock = clock
        self.calls: list[tuple[str, str]] = []

    async def complete(self, url: str, body: dict, wait: Wait) -> dict:
        self.calls.append(("complete", url))
        if url in self.refuse:
            raise WorkerError(url, "connect", "cannot reach: refused", dead=True)
        if self.clock is not None:
            self.clock.t += 0.2  # the prefill takes 200 ms
        return {"choices": [{"token_ids": [7], "text": "a", "finish_reason": "length"}],
                "kv_transfer_params": {"remote_host": url}}

    async def stream(self, url: str, body: dict, wait: Wait) -> AsyncIterator[dict]:
        self.calls.append(("stream", url))
        if url in self.refuse:
            raise WorkerError(url, "connect", "cannot reach: refused", dead=True)
        n = body["max_tokens"]
        for i in range(n):
            if self.break_after.get(url) == i:
                raise WorkerError(url, "closed", "stream broken")
            await asyncio.sleep(0)
            yield {"choices": [{"token_ids": [10 + i], "text": "b", "finish_reason": "length" if i == n - 1
                                else None}]}


def generation(pl: ConductorPlacement, client: FakeClient, max_tokens: int = 4, mode: str = "disaggregated"
               ) -> Generation:
    req = parse_completion({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True})
    return Generation(req, PROMPT, max_tokens, pl, client,  # type: ignore[arg-type]
                      RouterMetrics(), Timings(arrive=0.0), mode)


async def drain(gen: Generation, stop_after: int | None = None) -> list[Any]:
    out = []
    async with aclosing(gen.run()) as deltas:
        async for d in deltas:
            out.append(d)
            if stop_after is not None and len(out) >= stop_after:
                break
    return out


def test_handoff_decode_failover_keeps_prefill_and_closes_once():
    pl, cost, clock, closed = make("round_robin")
    client = FakeClient(refuse={"http://d0"}, clock=clock)
    gen = generation(pl, client)
    deltas = asyncio.run(drain(gen))
    assert [d.token_ids for d in deltas] == [[7], [10], [11], [12]] and deltas[-1].finish_reason == "length"
    assert [c for c in client.calls if c[0] == "complete"] == [("complete", "http://p0")]  # P once, not again
    assert [c[1] for c in client.calls if c[0] == "stream"] == ["http://d0", "http://d1"]
    assert len(closed) == 1 and pl.conductor.in_flight() == 0
    assert pl.conductor.counts == {"disaggregated": 1, "local": 0, "reject": 0}  # placed once, D moved
    assert [round(s, 3) for _, _, s in cost.prefills] == [0.2]  # P's prefill, reported once
    assert gen.t.prefill_worker == "http://p0" and gen.t.decode_worker == "http://d1"
    assert not pl.registry["http://d0"].healthy  # a refused connection marks it down in the one registry
    assert not pl.conductor.workers["http://d0"].healthy


def test_handoff_prefill_refused_replaces_whole_request_on_a_new_ticket():
    pl, _, _, closed = make("round_robin")
    client = FakeClient(refuse={"http://p0"})
    deltas = asyncio.run(drain(generation(pl, client)))
    assert deltas[-1].finish_reason == "length"
    assert [c[1] for c in client.calls if c[0] == "complete"] == ["http://p0", "http://p1"]
    assert len(closed) == 2 and pl.conductor.in_flight() == 0  # both tickets closed, each once


def test_handoff_closes_ticket_on_mid_stream_error():
    pl, _, _, closed = make("round_robin")
    client = FakeClient(break_after={"http://d0": 1, "http://p1": 0, "http://d1": 0, "http://p0": 0})
    with pytest.raises(RouterError) as e:  # every worker breaks: past the migration limit, a clear error
        asyncio.run(drain(generation(pl, client)))
    assert e.value.status == 502 and e.value.code == "migration_limit"
    assert len(closed) == 3 and pl.conductor.in_flight() == 0  # three attempts, each ticket closed once


def test_handoff_no_decode_worker_left_migrates_to_prefill():
    pl, _, _, closed = make("round_robin")
    client = FakeClient(refuse={"http://d0", "http://d1"})
    deltas = asyncio.run(drain(generation(pl, client)))
    assert [d.token_ids for d in deltas] == [[7], [10], [11], [12]] and deltas[-1].finish_reason == "length"
    assert [c[1] for c in client.calls if c[0] == "complete"] == ["http://p0"]
    assert client.calls[-1] == ("stream", "http://p0")  # P decodes locally: prompt + t1, 3 tokens left
    assert len(closed) == 2 and pl.conductor.in_flight() == 0


def test_handoff_closes_ticket_on_client_disconnect():
    pl, _, _, closed = make("round_robin")
    deltas = asyncio.run(drain(generation(pl, FakeClient(), max_tokens=8), stop_after=2))
    assert len(deltas) == 2 and len(closed) == 1 and pl.conductor.in_flight() == 0


def test_handoff_colocated_closes_ticket_once():
    pl, cost, _, closed = make("round_robin", members=(("colocated", "http://c0"),))
    deltas = asyncio.run(drain(generation(pl, FakeClient(), mode="colocated")))
    assert deltas[-1].finish_reason == "length" and len(closed) == 1 and pl.conductor.in_flight() == 0
