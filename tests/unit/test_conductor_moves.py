"""Moving running decodes off a worker that starts a prefill (pdserve.conductor.moves). Cost model as in
test_conductor_elastic: 1 ms per new prompt token, decode step 10 ms + 1 ms per sequence, 50 ms hand-off, 1 GB/s
for 1000 B/token, block size 16. A move of a decode with 40 tokens of context costs 50 ms (hand-off) + 40 us
(transfer) + 8 ms (its last partial block, 8 tokens, prefilled again on the old worker) = 58.04 ms, and delays the
prefill that caused it by those 8 ms: it moves when the stall exceeds 66.04 ms."""

import pytest

from pdserve.conductor import Decision
from pdserve.conductor.load import DecodeJob, PrefillJob
from pdserve.conductor.moves import Move, MoveConfig, apply_move, move_cost_s, plan_moves, stall_s, tail_tokens
from tests.unit.test_conductor_elastic import make

MOVE_40 = 0.05 + 40 * 1000 / 1e9 + 0.008


def running(c, worker: str, rid: str, context: int = 40, left: int = 100, started: bool = True) -> None:
    c.record(Decision("local", rid, None, worker), None,
             DecodeJob(rid, context, left, context + left, started_at=c.clock() if started else None, tokens_done=1))


def prefill_on(c, worker: str, rid: str, tokens: int) -> None:
    """``rid``'s prompt of ``tokens`` uncached tokens placed whole on ``worker`` (the conductor's reservation)."""
    c.record(Decision("local", rid, None, worker, placement="colocated"),
             PrefillJob(rid, tokens, 0, c.cost.prefill_s(tokens, 0), c.clock()), DecodeJob(rid, tokens, 8, tokens + 8))


def test_tail_and_cost():
    assert [tail_tokens(n, 16) for n in (0, 1, 16, 17, 40, 48)] == [0, 1, 16, 1, 8, 16]
    c = make()
    assert move_cost_s(c, 40) == pytest.approx(MOVE_40)


def test_a_long_prefill_moves_the_decode_that_pays_to_the_idle_worker():
    c = make(3)
    running(c, "e0", "r", context=40)
    running(c, "e1", "busy")  # e1 decodes one request, e2 none: e2 has the lowest predicted TPOT
    prefill_on(c, "e0", "long", 160)
    moves = plan_moves(c, "long", MoveConfig())
    assert [(m.request_id, m.src, m.dst) for m in moves] == [("r", "e0", "e2")]
    m = moves[0]
    assert m.stall_s == pytest.approx(0.160) and m.cost_s == pytest.approx(MOVE_40)
    assert "stall of 160 ms > a move of 58 ms" in m.reason
    # recorded at once: a split, P = e0 for the 8-token tail (ahead of the long prefill), D = e2
    d = c.decision_of("r")
    assert (d.kind, d.prefill, d.decode, d.cached_tokens) == ("disaggregated", "e0", "e2", 32)
    assert list(c.workers["e0"].prefills) == ["r", "long"]
    assert c.workers["e0"].prefills["r"].new_tokens == 8
    assert "r" not in c.workers["e0"].decodes and c.workers["e2"].decodes["r"].remaining_tokens == 100
    assert c.workers["e2"].decodes["r"].started_at is None  # until the tail's hand-off is done
    c.prefill_done("r")
    assert c.workers["e2"].decodes["r"].started_at is not None and "r" not in c.workers["e0"].prefills
    c.finished("r")
    assert "r" not in c.workers["e2"].decodes and c.in_flight() == 2  # long and busy remain


def test_a_short_prefill_moves_nothing():
    c = make()
    running(c, "e0", "r", context=40)
    prefill_on(c, "e0", "short", 50)  # a 50 ms stall < a 58 ms move
    assert plan_moves(c, "short", MoveConfig()) == []
    prefill_on(c, "e0", "medium", 62)  # a 62 ms stall > the 58 ms move, but not once the 8 ms tail delays medium
    assert plan_moves(c, "medium", MoveConfig()) == []
    c.finished("medium")
    assert plan_moves(c, "short", MoveConfig()) == []
    assert "r" in c.workers["e0"].decodes and c.decision_of("r").kind == "local"


def test_min_gain_and_max_moves():
    c = make()
    running(c, "e0", "r", context=40)
    prefill_on(c, "e0", "p", 100)  # gains 100 - 58 - 8 = 34 ms
    assert plan_moves(c, "p", MoveConfig(min_gain_s=0.035)) == []
    assert plan_moves(c, "p", MoveConfig(max_moves=0)) == []
    assert [m.request_id for m in plan_moves(c, "p", MoveConfig(min_gain_s=0.03))] == ["r"]
    c = make()
    for i, ctx in enumerate((40, 20, 90)):
        running(c, "e0", f"r{i}", context=ctx)
    prefill_on(c, "e0", "p", 160)
    # cheapest move (least context) first: r1 (20 tokens, tail 4), then r0 (40)
    assert [m.request_id for m in plan_moves(c, "p", MoveConfig(max_moves=2))] == ["r1", "r0"]


def test_no_room_elsewhere_moves_nothing():
    c = make()
    c.workers["e1"].kv_capacity_tokens = 100  # 40 + 100 tokens do not fit
    running(c, "e0", "r", context=40)
    prefill_on(c, "e0", "long", 160)
    assert plan_moves(c, "long", MoveConfig()) == []
    c = make()
    running(c, "e0", "r", context=40)
    prefill_on(c, "e1", "other", 400)  # e1 is itself prefilling a long prompt: it takes no decode
    prefill_on(c, "e0", "long", 160)
    assert plan_moves(c, "long", MoveConfig()) == []
    c = make()
    c.set_health("e1", False)
    running(c, "e0", "r", context=40)
    prefill_on(c, "e0", "long", 160)
    assert plan_moves(c, "long", MoveConfig()) == []


def test_no_candidate():
    c = make()
    running(c, "e0", "waiting", started=False)  # its KV is not there yet
    running(c, "e0", "ending", left=1)  # one token left: nothing to gain
    prefill_on(c, "e0", "long", 160)
    assert plan_moves(c, "long", MoveConfig()) == []
    assert plan_moves(c, "unknown", MoveConfig()) == []
    running(c, "e0", "r", context=40)
    assert plan_moves(c, "long", MoveConfig(enabled=False)) == []
    # the router cannot move it now (not streaming from e0): it stays, nothing recorded
    assert plan_moves(c, "long", MoveConfig(), can_move=lambda rid, src: False) == []
    assert "r" in c.workers["e0"].decodes


def test_chunked_stall_counts_every_step():
    c = make(chunk_tokens=64)
    running(c, "e0", "r", context=40)
    prefill_on(c, "e0", "long", 160)
    w = c.workers["e0"]
    # 63 prompt tokens per step next to one decode: 3 steps, each stalled by a 63-token chunk
    assert stall_s(c, w, w.prefills["long"]) == pytest.approx(3 * 0.063)
    assert [m.request_id for m in plan_moves(c, "long", MoveConfig())] == ["r"]


def test_apply_move_releases_the_old_placement():
    c = make()
    running(c, "e0", "r", context=17)
    d = apply_move(c, Move("r", "e0", "e1", 17, 5, 0.2, 0.1))
    assert (d.prefill, d.decode, d.cached_tokens, d.ttft_s) == ("e0", "e1", 16, pytest.approx(0.001))
    assert c.in_flight() == 1 and "r" not in c.workers["e0"].decodes


def test_config_is_validated():
    for bad in ({"min_gain_s": -1.0}, {"max_moves": -1}, {"max_moves": True}, {"wait_s": float("inf")}):
        with pytest.raises(ValueError):
            MoveConfig(**bad)
