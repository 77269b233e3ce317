"""Attempts (pdserve.router.run.attempt): every call to a worker reads its failure through one rule
(failures.classify) and logs one line when it ends. Here the prompt_logprobs path (the whole request sent
unstreamed to one worker), whose own copy of the rule used to drop a merely slow worker as if dead and answer a 502
where the request could move on (issue 23), against fake worker calls."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest

from pdserve.router.api.protocol import parse_completion
from pdserve.router.errors import RouterError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.run.attempt import Attempt, AttemptContext
from pdserve.router.run.failures import Migrate, Retry, classify
from pdserve.router.run.generation import Generation
from pdserve.router.run.output import Output
from pdserve.router.run.stops import StopStrings
from pdserve.router.run.timings import Timings
from pdserve.router.workers.client import Probe, Wait, WorkerError
from tests.unit.test_router_ticket import PROMPT, make

C0, C1 = "http://c0", "http://c1"
SCORES = [None, {"5": {"logprob": -1.0}}]


class ScoringClient:
    """Unstreamed answers with prompt_logprobs; ``fail``: url -> the WorkerErrors its next calls raise."""

    def __init__(self, fail: dict[str, list[WorkerError]] | None = None, down: frozenset[str] = frozenset()) -> None:
        self.fail = fail or {}
        self.down = down  # workers whose /health probe is refused
        self.calls: list[tuple[str, dict]] = []
        self.probed: list[str] = []

    async def check(self, url: str, timeout_s: float) -> Probe:
        self.probed.append(url)
        if url in self.down:
            return Probe(False, "unreachable: connection refused", True)
        return Probe(True, "HTTP 200")

    async def complete(self, url: str, body: dict, wait: Wait) -> dict:
        self.calls.append((url, body))
        if self.fail.get(url):
            raise self.fail[url].pop(0)
        n = body["max_tokens"]
        return {"choices": [{"text": "x" * n, "token_ids": list(range(10, 10 + n)), "finish_reason": "length",
                             "prompt_logprobs": SCORES}]}

    async def stream(self, url: str, body: dict, wait: Wait) -> AsyncIterator[dict]:
        raise AssertionError("a prompt_logprobs request is sent unstreamed")
        yield {}


def scored(pl: Any, client: ScoringClient, rid: str = "r-0") -> Generation:
    req = parse_completion({"prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 1, "echo": True})
    req.request_id = rid
    return Generation(req, PROMPT, 3, pl, client, RouterMetrics(), Timings(arrive=0.0),  # type: ignore[arg-type]
                      "colocated")


async def drain(gen: Generation) -> list[Any]:
    async with aclosing(gen.run()) as deltas:
        return [d async for d in deltas]


def colocated(*urls: str) -> Any:
    return make("round_robin", members=tuple(("colocated", u) for u in urls))


def test_a_slow_worker_on_the_prompt_logprobs_path_is_waited_for_not_dropped_as_dead():
    """It never accepted the call in time (connect timeout): left out for one round only, so the request, with
    nothing else to run on, waits on it again; the registry keeps it healthy."""
    pl, _, _, closed = colocated(C0)
    slow = WorkerError(C0, "connect", "no connection within 5 s")
    client = ScoringClient({C0: [slow]})
    gen = scored(pl, client)
    out = asyncio.run(drain(gen))
    assert [d.token_ids for d in out] == [[10, 11, 12]] and out[-1].finish_reason == "length"
    assert gen.prompt_logprobs == SCORES and [u for u, _ in client.calls] == [C0, C0]
    assert pl.registry[C0].healthy and len(closed) == 2 and pl.conductor.in_flight() == 0


def test_slow_workers_under_n2_each_choice_is_served():
    """n=2: each choice's slow first call is waited out, not counted as a dead worker."""
    pl, _, _, _ = colocated(C0, C1)
    client = ScoringClient({C0: [WorkerError(C0, "connect", "no connection within 5 s")],
                            C1: [WorkerError(C1, "connect", "no connection within 5 s")]})

    async def both() -> list[list[Any]]:
        return list(await asyncio.gather(drain(scored(pl, client, "r-0")), drain(scored(pl, client, "r-1"))))

    outs = asyncio.run(both())
    assert all(o[-1].token_ids == [10, 11, 12] for o in outs)
    assert pl.registry[C0].healthy and pl.registry[C1].healthy and pl.conductor.in_flight() == 0


def test_a_prompt_logprobs_request_whose_worker_dies_migrates(caplog):
    """The worker took the call and died with it: the request moves to another worker instead of a 502, and the
    failed attempt's log line says what failed."""
    pl, _, _, closed = colocated(C0, C1)
    client = ScoringClient({C0: [WorkerError(C0, "closed", "connection lost before the answer: Server "
                                                         "disconnected")]})
    gen = scored(pl, client)
    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        out = asyncio.run(drain(gen))
    assert out[-1].token_ids == [10, 11, 12] and gen.prompt_logprobs == SCORES
    assert [u for u, _ in client.calls] == [C0, C1] and gen.migrations == 1
    assert gen.metrics.registry.get_sample_value("pdserve_router_migrations_total", {"role": "colocated"}) == 1.0
    assert len(closed) == 2 and pl.conductor.in_flight() == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any("scored attempt on colocated worker http://c0: migrate (worker http://c0: connection lost" in m
               and "0 token(s) out" in m for m in lines), lines


@pytest.mark.parametrize("dead", [True, False])
def test_a_worker_that_dropped_an_accepted_call_is_probed_at_once(dead):
    """Its connection was lost: its /health is probed now, not at the next health tick; refused -> out of the
    placement at once, answering -> it keeps serving (the request has moved on either way)."""
    pl, _, _, _ = colocated(C0, C1)
    lost = WorkerError(C0, "closed", "connection lost before the answer: [Errno 104] Connection reset by peer")
    client = ScoringClient({C0: [lost]}, down=frozenset({C0}) if dead else frozenset())

    async def run() -> list[Any]:
        out = await drain(scored(pl, client))
        await asyncio.sleep(0)  # the probe's task
        return out

    assert asyncio.run(run())[-1].token_ids == [10, 11, 12]
    assert client.probed == [C0] and pl.registry[C0].healthy is not dead and pl.registry[C1].healthy


def test_a_4xx_on_the_prompt_logprobs_path_is_the_clients_error():
    pl, _, _, _ = colocated(C0, C1)
    client = ScoringClient({C0: [WorkerError(C0, "http", "HTTP 400", 400, {"error": {"message": "bad", "code": 400}})]})
    with pytest.raises(RouterError) as e:
        asyncio.run(drain(scored(pl, client)))
    assert e.value.status == 400 and [u for u, _ in client.calls] == [C0]


@pytest.mark.parametrize("kind,started,mid,want", [
    ("connect", False, False, Retry), ("closed", False, False, Migrate), ("timeout", True, True, Migrate),
    ("http", False, False, RouterError), ("protocol", True, True, RouterError)])
def test_classify_is_the_one_rule(kind, started, mid, want):
    e = WorkerError("http://w", kind, "x", 503 if kind == "http" and want is Migrate else 400)
    out = classify(e, "decode", started, mid)
    assert isinstance(out, want)
    if isinstance(out, Retry):
        assert not out.dead  # slow, not dead: only a refused connection is evidence of death
    if isinstance(out, RouterError) and mid:
        assert out.status == 502 and "failed mid-request" in out.message


def test_an_attempt_logs_its_outcome_once(caplog):
    pl, _, _, _ = colocated(C0)
    t = Timings(arrive=0.0)
    out = Output(StopStrings([], False), t)
    ctx = AttemptContext(ScoringClient(), RouterMetrics(), pl.registry, t, out, "r-9")  # type: ignore[arg-type]
    ticket = pl.choose(PROMPT, request_id="r-9", max_tokens=3)
    a = Attempt(ctx, ticket, ticket.decode, "colocated", "whole")
    with caplog.at_level(logging.DEBUG, logger="pdserve.router"):
        a.end("ok", "finished: length")
        a.end("interrupted", "later")
    assert [r.getMessage() for r in caplog.records] == [
        "request r-9: whole attempt on colocated worker http://c0: ok (finished: length); 0 token(s) out"]
    ticket.close()
