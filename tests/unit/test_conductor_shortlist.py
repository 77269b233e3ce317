"""The candidate bound at fleet scale (:mod:`pdserve.conductor.shortlist`): load orders kept as load changes, and a
placement that weighs the prefix holders plus the least-loaded few."""

import random

import pytest

from pdserve.conductor import Conductor, ConductorConfig, Decision, OnlineCostModel, PlacementRequest
from pdserve.conductor.cost_model import Priors
from pdserve.conductor.load import DecodeJob, PrefillJob, WorkerLoad
from pdserve.conductor.shortlist import LoadOrder, decode_key, prefill_key
from pdserve.hashing import block_hashes

from .fake_clock import Clock

BS = 16
PROMPT = list(range(160))  # 10 blocks


def cost() -> OnlineCostModel:
    return OnlineCostModel(1000, Priors(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0),
                                        bandwidth_bytes_s=1e9, transfer_overhead_s=0.0, handoff_s=0.05))


def make(n_p: int, n_d: int, shortlist: int, **cfg) -> Conductor:
    cfg.setdefault("local_prefill_tokens", 0)
    c = Conductor(ConductorConfig(block_size=BS, **cfg), cost(), Clock(), shortlist=shortlist)
    for i in range(n_p):
        c.add_worker(f"p{i}", "prefill", 0)
    for i in range(n_d):
        c.add_worker(f"d{i}", "decode", 100_000)
    return c


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> PlacementRequest:
    return PlacementRequest(rid, len(tokens), block_hashes(tokens, BS), max_tokens)


def test_load_order_follows_changes():
    ws = [WorkerLoad(f"w{i}", "prefill", 0) for i in range(5)]
    order = LoadOrder(prefill_key)
    for w in reversed(ws):
        order.update(w)
    assert [w.worker_id for w in order.all()] == ["w0", "w1", "w2", "w3", "w4"]  # equal load: by id
    ws[0].prefills["a"] = PrefillJob("a", 100, 0, 0.5, 0.0)
    ws[2].prefills["b"] = PrefillJob("b", 10, 0, 0.1, 0.0)
    order.update(ws[0])
    order.update(ws[2])
    assert [w.worker_id for w in order.all()] == ["w1", "w3", "w4", "w2", "w0"]
    assert [w.worker_id for w in order.least(2, lambda w: w.worker_id != "w3")] == ["w1", "w4"]
    ws[0].prefills.clear()
    order.update(ws[0])
    order.discard("w1")
    assert [w.worker_id for w in order.all()] == ["w0", "w3", "w4", "w2"] and "w1" not in order and len(order) == 4


def test_load_order_random_changes_stay_sorted():
    rng = random.Random(3)
    ws = {f"w{i}": WorkerLoad(f"w{i}", "decode", 0) for i in range(30)}
    order = LoadOrder(decode_key)
    for _ in range(500):
        w = ws[rng.choice(list(ws))]
        if w.decodes and rng.random() < 0.5:
            w.decodes.pop(rng.choice(list(w.decodes)))
        else:
            rid = f"r{rng.randrange(10**6)}"
            w.decodes[rid] = DecodeJob(rid, 10, 10, rng.randrange(1, 500))
        if rng.random() < 0.05:
            order.discard(w.worker_id)
        else:
            order.update(w)
    got = order.all()
    assert [decode_key(w) for w in got] == sorted(decode_key(w) for w in got)


def test_holder_outside_the_least_loaded_is_a_candidate():
    """p7 has the longest queue, far from the 2 least-loaded prefill workers, but it holds 8 of the prompt's 10
    blocks: queue 0.08 s + 32 new tokens (0.112 s) beats p0's 0.01 s + 160 new tokens (0.17 s)."""
    c = make(8, 2, shortlist=2)
    for i in range(8):
        c.record(Decision("disaggregated", f"q{i}", f"p{i}", "d1"),
                 PrefillJob(f"q{i}", 10, 0, 0.01 * (i + 1), c.clock()), DecodeJob(f"q{i}", 10, 1, 11))
    c.blocks_stored("p7", block_hashes(PROMPT, BS)[:8])
    d = c.place(req("r", PROMPT))
    assert (d.prefill, d.cached_tokens, d.decode) == ("p7", 128, "d0")
    assert d.ttft_s == pytest.approx(0.112)
    c.blocks_removed("p7", block_hashes(PROMPT, BS)[:8])
    assert c.place(req("s", PROMPT)).prefill == "p0"


def test_least_loaded_follows_placements_and_releases():
    c = make(6, 3, shortlist=1)
    picks = [c.place(req(f"r{i}", list(range(i * 500, i * 500 + 100)))) for i in range(3)]
    assert [d.prefill for d in picks] == ["p0", "p1", "p2"]  # each placement re-keys its worker
    assert [d.decode for d in picks] == ["d0", "d1", "d2"]
    c.prefill_done("r1")
    c.finished("r0")
    d = c.place(req("r3", list(range(9000, 9100))))
    assert (d.prefill, d.decode) == ("p0", "d0")  # released: least loaded again, first by id
    c.set_health("p0", False)
    c.set_health("p1", False)
    c.remove_worker("p3")
    assert c.place(req("r4", list(range(9500, 9600)))).prefill == "p4"
    assert c.place(req("r5", list(range(9700, 9800)))).prefill == "p5"
    d = c.place(req("r6", list(range(9900, 10000))), exclude=frozenset({"p4", "p5"}))
    assert d.prefill == "p2"  # the one live prefill worker left (r2 still queued there)


def test_excluded_unhealthy_and_removed_are_never_picked():
    c = make(4, 4, shortlist=1)
    c.set_health("p0", False)
    c.remove_worker("d0")
    d = c.place(req("r", PROMPT), exclude=frozenset({"p1", "d1"}))
    assert (d.prefill, d.decode) == ("p2", "d2")
    c.set_health("p0", True)
    assert c.place(req("s", list(range(500, 600)))).prefill == "p0"


def test_decode_beyond_the_shortlist_when_none_of_it_fits():
    c = make(2, 4, shortlist=2)
    c.workers["d0"].kv_capacity_tokens = 50  # prompt + max_tokens = 168 fits on neither of the 2 least loaded
    c.workers["d1"].kv_capacity_tokens = 50
    d = c.place(req("r", PROMPT))
    assert d.decode == "d2" and "KV room" not in d.reason


@pytest.mark.parametrize("seed", [1, 2])
def test_same_decisions_as_full_scan_when_shortlist_covers_each_role(seed):
    rng = random.Random(seed)
    small, full = make(5, 5, shortlist=5, local_prefill_tokens=None), make(5, 5, shortlist=10,
                                                                            local_prefill_tokens=None)
    for c in (small, full):
        c.blocks_stored("p3", block_hashes(PROMPT, BS)[:6])
    for i in range(60):
        toks = PROMPT[:rng.randint(1, 160)] + [rng.randrange(5000) for _ in range(rng.randint(1, 200))]
        got = [c.place(req(f"r{i}", toks)) for c in (small, full)]
        assert got[0] == got[1]
        for c in (small, full):
            c.clock.t += 0.01
            if i >= 6:
                c.prefill_done(f"r{i - 6}")
            if i >= 12:
                c.finished(f"r{i - 12}")


def test_shortlist_must_be_positive():
    with pytest.raises(ValueError, match="shortlist"):
        Conductor(ConductorConfig(), cost(), shortlist=0)
