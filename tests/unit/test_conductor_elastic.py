"""Elastic roles (pdserve.conductor.elastic): every worker may prefill or decode; the conductor picks colocated or
split per request. Cost model as in test_conductor_policy: 1 ms per new prompt token, decode step 10 ms + 1 ms per
sequence, 50 ms hand-off, 1 GB/s for 1000 B/token; ``local_stall_s`` 50 ms and ``split_harm_handoffs`` 1, so on an
idle worker a prompt over 50 uncached tokens is long (its prefill stalls a decode next to it over the 50 ms limit
and over one hand-off); the rule's own tests are in test_conductor_elastic_long."""

import pytest

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel, PlacementRequest
from pdserve.conductor.cost_model import Priors
from pdserve.conductor.elastic import is_long, prefilling_long
from pdserve.conductor.load import DecodeJob
from pdserve.hashing import block_hashes

from .fake_clock import Clock

BS = 16
SHORT = list(range(16))  # 16 ms prefill: short
LONG = list(range(1000, 1160))  # 160 ms prefill: long


def make(n: int = 2, clock: Clock | None = None, **cfg) -> Conductor:
    cost = OnlineCostModel(1000, Priors(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0),
                                        bandwidth_bytes_s=1e9, transfer_overhead_s=0.0, handoff_s=0.05))
    c = Conductor(ConductorConfig(block_size=BS, **cfg), cost, clock or Clock())
    for i in range(n):
        c.add_worker(f"e{i}", "elastic", 100_000)
    return c


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> PlacementRequest:
    return PlacementRequest(rid, len(tokens), block_hashes(tokens, BS), max_tokens)


def decoding(c: Conductor, worker: str, n: int) -> None:
    """n requests decoding on ``worker`` (16-token prompts, 100 tokens left each), as the load view holds them
    after their prefill."""
    for i in range(n):
        rid = f"{worker}-run{i}"
        c.workers[worker].decodes[rid] = DecodeJob(rid, 16, 100, 116, started_at=c.clock(), tokens_done=1)


def test_short_prompt_on_idle_pool_is_colocated():
    c = make()
    d = c.place(req("r", SHORT))
    assert (d.kind, d.prefill, d.decode) == ("local", None, "e0")
    assert d.ttft_s == pytest.approx(0.016)
    assert "elastic colocated on e0" in d.reason
    assert c.counts == {"disaggregated": 0, "local": 1, "reject": 0}


def test_long_prompt_while_another_worker_decodes_is_split_onto_the_idle_one():
    c = make()
    decoding(c, "e0", 2)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "e1", "e0")
    assert d.ttft_s == pytest.approx(0.160)  # e1 is idle: no queue, no decode step shared
    assert d.tpot_s == pytest.approx(0.010 + 0.001 * 3)  # e0's two decodes plus this one
    assert "elastic split" in d.reason


def test_long_prompt_on_idle_pool_is_split_so_the_prefiller_keeps_no_decode():
    c = make()
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "e0", "e1")


def test_prefill_goes_where_it_stalls_nobody():
    """Both workers decode; the long prefill goes to the one with fewer decodes (harm = stall x decodes)."""
    c = make()
    decoding(c, "e0", 3)
    decoding(c, "e1", 1)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "e1", "e0")


def test_worker_prefilling_a_long_prompt_gets_no_new_decode():
    clock = Clock()
    c = make(clock=clock)
    decoding(c, "e0", 1)
    d = c.place(req("long", LONG))
    assert (d.prefill, d.decode) == ("e1", "e0")
    assert prefilling_long(c, c.workers["e1"]) and not prefilling_long(c, c.workers["e0"])
    clock.t += 0.15  # e1's prefill is nearly done: only 10 ms of queue left, and e1 runs no decode
    d2 = c.place(req("short", SHORT))
    # colocated on e1 would cost least (10 ms queue + 16 ms), but e1 is prefilling a long prompt: no decode there.
    # Colocated on e0 costs 16 + 11 ms (a shared step) + 16 ms of stall to e0's decode = 43 ms; prefilling on e1
    # behind the long one and decoding on e0 costs 26 ms and stalls nobody.
    assert (d2.kind, d2.prefill, d2.decode) == ("disaggregated", "e1", "e0")
    c.prefill_done("long")
    assert not prefilling_long(c, c.workers["e1"])
    d3 = c.place(req("short2", list(range(500, 516))))
    assert (d3.kind, d3.decode) == ("local", "e1")  # e0 now runs three decodes; e1 none


def test_long_prompt_blocked_decoders_leave_only_colocated_when_alone():
    """With one live worker there is no split: the request runs colocated."""
    c = make(n=1)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("local", None, "e0")


def test_tpot_target_turns_a_split_into_colocated():
    """D=e0 runs five decodes: its TPOT (16 ms) misses the 12 ms target; colocated on idle e1 meets it (11 ms)."""
    c = make(tpot_slo_s=0.012)
    decoding(c, "e0", 5)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("local", None, "e1")
    assert d.tpot_s == pytest.approx(0.011)


def test_reject_when_every_option_misses_the_ttft_target():
    c = make(ttft_slo_s=0.1)
    d = c.place(req("long", LONG))
    assert d.kind == "reject" and d.code == "slo" and d.retry_after_s >= 1
    assert "predicted TTFT 160 ms > target 100 ms" in d.reason
    assert c.in_flight() == 0  # nothing reserved
    ok = c.place(req("short", SHORT))
    assert ok.kind == "local"


def test_worker_limit_rejects_when_every_elastic_worker_is_full():
    c = make(max_inflight_per_worker=1)
    assert c.place(req("a", SHORT)).decode == "e0"
    assert c.place(req("b", list(range(200, 216)))).decode == "e1"
    d = c.place(req("c", list(range(300, 316))))
    assert d.kind == "reject" and d.code == "worker_limit"


def test_prefix_cache_makes_a_long_prompt_short():
    c = make()
    decoding(c, "e0", 1)
    c.blocks_stored("e1", block_hashes(LONG, BS)[:9])  # 144 of 160 tokens cached on e1
    d = c.place(req("long", LONG))
    assert (d.kind, d.decode, d.cached_tokens) == ("local", "e1", 144)


def test_local_prefill_tokens_threshold_sets_long():
    c = make(local_prefill_tokens=200)
    assert not is_long(c, 160, 0) and is_long(c, 201, 0)
    d = c.place(req("long", LONG))
    assert d.kind == "local"


def test_long_means_longer_than_the_stall_limit_and_the_hand_off():
    c = make()
    assert not is_long(c, 50, 0) and is_long(c, 51, 0)  # 50 ms stall limit, 50 ms hand-off + ~0 transfer
    c.cost.handoff_s = 0.2  # hand-offs observed slow: a split pays only for prefills over 200 ms
    assert not is_long(c, 160, 0) and is_long(c, 201, 0)
    d = c.place(req("long", LONG))
    assert (d.kind, d.decode) == ("local", "e0")


def test_baselines_place_whole_requests_round_robin():
    c = make(policy="round_robin")
    ds = [c.place(req(f"r{i}", LONG)) for i in range(3)]
    assert [(d.kind, d.decode) for d in ds] == [("local", "e0"), ("local", "e1"), ("local", "e0")]


def test_lifecycle_releases_split_and_colocated():
    c = make()
    decoding(c, "e0", 1)
    d = c.place(req("long", LONG))
    assert d.kind == "disaggregated"
    c.prefill_done("long")
    c.decode_progress("long", 1)
    c.decode_progress("long", 3)
    c.finished("long")
    c.workers["e0"].decodes.clear()
    assert all(not w.prefills and not w.decodes for w in c.workers.values())
    assert c.in_flight() == 0


def test_replace_decode_moves_an_elastic_decode():
    c = make(n=3)
    d = c.place(req("long", LONG))
    assert d.kind == "disaggregated"
    new = c.replace_decode("long", frozenset())
    assert new != d.decode and "long" in c.workers[new].decodes


def test_many_workers_long_prompt_goes_to_an_idle_prefiller_and_a_decoder():
    c = make(n=64)
    for i in range(63):
        decoding(c, f"e{i}", 1 + i % 3)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill) == ("disaggregated", "e63")  # the only worker with no decode to stall
    assert d.decode in {f"e{i}" for i in range(0, 63, 3)}  # among the least busy decoders (one decode each)
