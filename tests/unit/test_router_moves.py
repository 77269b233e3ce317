"""A voluntary move of a running decode (pdserve.router.fleet.move) against fake workers: an elastic placement that puts
a long prefill on the worker where a decode streams moves that decode: the router stops reading the old worker,
asks it for a one-token prefill of prompt + the streamed tokens (its P -> D hand-off answer) and continues on the
new worker with that KV; one stream for the client, not a failure, the long prefill waits for the move's tail."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
from pdserve.conductor.cost_model import Priors
from pdserve.conductor.moves import MoveConfig
from pdserve.router.fleet.move import wait_moves
from pdserve.router.fleet.placement import ConductorPlacement
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.run.generation import Generation
from pdserve.router.workers.client import Wait
from tests.unit.test_router_app import model_dir  # noqa: F401  (fixture)
from tests.unit.test_router_ticket import PROMPT, Clock, FakeClient, generation

E0, E1 = "http://e0", "http://e1"
LONG = list(range(500, 700))  # 200 uncached tokens: a 200 ms prefill, a stall larger than a move (~53 ms)


def elastic(moves: MoveConfig | None = None) -> ConductorPlacement:
    cost = OnlineCostModel(1000, Priors(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0),
                                        bandwidth_bytes_s=1e9, transfer_overhead_s=0.0, handoff_s=0.05))
    c = Conductor(ConductorConfig(block_size=4, local_prefill_tokens=100), cost, Clock())
    members = [(role, url) for url in (E0, E1) for role in ("prefill", "decode", "elastic")]
    return ConductorPlacement(c, WorkerRegistry(members), moves)


class Paced(FakeClient):
    """Streams one token per loop turn and a little time, and records every body."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[tuple[str, str, dict]] = []

    async def complete(self, url: str, body: dict, wait: Wait) -> dict:
        self.bodies.append(("complete", url, body))
        return await super().complete(url, body, wait)

    async def stream(self, url: str, body: dict, wait: Wait) -> AsyncIterator[dict]:
        self.bodies.append(("stream", url, body))
        async for obj in super().stream(url, body, wait):
            await asyncio.sleep(0.002)
            yield obj


async def _run(gen: Generation, got: list[Any]) -> None:
    async with aclosing(gen.run()) as deltas:
        async for d in deltas:
            got.append(d)


async def _move_scenario(pl: ConductorPlacement, client: Paced) -> tuple[Generation, list[Any], Any]:
    gen = generation(pl, client, max_tokens=12)
    got: list[Any] = []
    task = asyncio.create_task(_run(gen, got))
    while len(gen.token_ids) < 3:
        await asyncio.sleep(0.001)
    # the long prefill lands on e0, where the decode runs (e1 left out of this placement only)
    long = pl.choose(LONG, exclude=frozenset({E1}), request_id="long", max_tokens=4)
    await wait_moves(long.waits, 2.0)
    await task
    long.close()
    return gen, got, long


def test_a_long_prefill_moves_the_running_decode_through_a_handoff():
    pl = elastic()
    client = Paced()
    gen, got, long = asyncio.run(_move_scenario(pl, client))
    assert long.decode.url == E0 and len(long.waits) == 1 and long.wait_s == 2.0
    calls = [(k, u) for k, u, _ in client.bodies]
    assert calls == [("stream", E0), ("complete", E0), ("stream", E1)]
    _, _, p_body = client.bodies[1]
    _, _, d_body = client.bodies[2]
    n = len(p_body["prompt"]) - len(PROMPT)  # tokens streamed from e0 before the move
    assert n >= 3 and p_body["prompt"] == PROMPT + gen.token_ids[:n] and p_body["max_tokens"] == 1
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}  # e0 leases the KV as a P would
    assert d_body["prompt"] == p_body["prompt"] + [7] and d_body["max_tokens"] == 12 - n - 1
    assert d_body["kv_transfer_params"] == {"remote_host": E0}  # e1 reads it from e0 through the connector
    assert gen.token_ids == list(range(10, 10 + n)) + [7] + list(range(10, 10 + 11 - n))
    assert got[-1].finish_reason == "length" and sum(len(d.token_ids) for d in got) == 12
    m = gen.metrics.registry
    assert m.get_sample_value("pdserve_router_moves_total") == 1.0
    assert m.get_sample_value("pdserve_router_move_gap_seconds_count") == 1.0
    assert gen.migrations == 0 and m.get_sample_value("pdserve_router_migrations_total", {"role": "decode"}) is None
    assert gen.t.decode_worker == E1
    assert pl.conductor.in_flight() == 0 and not len(pl.movers)
    assert all(not w.decodes and not w.prefills for w in pl.conductor.workers.values())


def test_moves_off_places_nothing_more():
    pl = elastic(MoveConfig(enabled=False))
    client = Paced()
    gen, got, long = asyncio.run(_move_scenario(pl, client))
    assert long.waits == () and [(k, u) for k, u, _ in client.bodies] == [("stream", E0)]
    assert gen.metrics.registry.get_sample_value("pdserve_router_moves_total") == 0.0


def test_only_a_decode_streaming_from_the_worker_can_move():
    pl = elastic()
    gen = generation(pl, Paced(), max_tokens=12)
    assert not gen.moves.movable_from(E0)  # no ticket yet
    t = pl.choose(PROMPT, request_id=gen.req.request_id, max_tokens=12)
    gen.ticket = t
    assert not gen.moves.movable_from(E0)  # prompt not computed yet
    t.prefill_done()

    async def awaiting() -> None:
        assert gen.moves.movable_from(E0) and not gen.moves.movable_from(E1)
        gen.ctx.handoff_since = 1.0  # a P -> D hand-off not yet answered by D
        assert not gen.moves.movable_from(E0)
        gen.ctx.handoff_since = None
        gen.output.token_ids[:] = list(range(11))  # one token left
        assert not gen.moves.movable_from(E0)

    asyncio.run(awaiting())
    t.close()


def test_a_move_that_comes_too_late_is_released():
    """The request's tokens were all out when its move came: the move's ticket is closed unused."""
    pl = elastic()
    gen = generation(pl, FakeClient(), max_tokens=2)
    gen.output.token_ids[:] = [10, 11]  # everything streamed; only the finish is left
    late = pl.choose(PROMPT, request_id=gen.req.request_id, max_tokens=2)
    gen.moves.pending = late

    async def go() -> list[Any]:
        async with aclosing(gen.run()) as deltas:
            return [d async for d in deltas]

    out = asyncio.run(go())
    assert [d.finish_reason for d in out] == ["length"]
    assert late.closed and gen.moves.pending is None and pl.conductor.in_flight() == 0


def test_wait_moves_returns_at_the_tail_prefill_or_the_timeout():
    pl = elastic()
    a = pl.choose(PROMPT, request_id="a", max_tokens=4)
    b = pl.choose(PROMPT, request_id="b", max_tokens=4)
    a.handed, b.handed = asyncio.Event(), asyncio.Event()

    async def go() -> tuple[float, float]:
        asyncio.get_running_loop().call_later(0.01, a.prefill_done)
        asyncio.get_running_loop().call_later(0.02, b.close)  # a move whose run ended: nothing to wait for
        done = await wait_moves((a, b), 5.0)
        c = pl.choose(PROMPT, request_id="c", max_tokens=4)
        c.handed = asyncio.Event()
        timed_out = await wait_moves((c,), 0.05)
        c.close()
        return done, timed_out

    done, timed_out = asyncio.run(go())
    assert 0.015 <= done < 1.0 and 0.05 <= timed_out < 1.0
    a.close()
    assert pl.conductor.in_flight() == 0


def test_router_flag_turns_moves_off(model_dir):
    from pdserve.router.__main__ import config_from_args

    args = ["--model-dir", str(model_dir), "--elastic", E0, E1, "--policy", "conductor"]
    assert config_from_args(args).moves and not config_from_args([*args, "--no-moves"]).moves
