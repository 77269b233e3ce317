import pytest

from pdserve.conductor import (
    Conductor,
    ConductorConfig,
    ConductorConfigError,
    Decision,
    OnlineCostModel,
    PlacementRequest,
)
from pdserve.conductor.cost_model import Priors
from pdserve.conductor.load import DecodeJob, PrefillJob
from pdserve.conductor.policy import NoWorker
from pdserve.hashing import block_hashes

from .fake_clock import Clock

BS = 16


def cost() -> OnlineCostModel:
    # 1 ms per new token; decode step 10 ms + 1 ms per sequence; 1 GB/s; 50 ms hand-off; 1000 B/token
    return OnlineCostModel(1000, Priors(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0),
                                        bandwidth_bytes_s=1e9, transfer_overhead_s=0.0, handoff_s=0.05))


def make(n_p=2, n_d=1, clock=None, **cfg) -> Conductor:
    cfg.setdefault("local_prefill_tokens", 0)  # most tests look at P choice; local has its own tests
    c = Conductor(ConductorConfig(block_size=BS, **cfg), cost(), clock or Clock())
    for i in range(n_p):
        c.add_worker(f"p{i}", "prefill", 0)
    for i in range(n_d):
        c.add_worker(f"d{i}", "decode", 100_000)
    return c


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> PlacementRequest:
    return PlacementRequest(rid, len(tokens), block_hashes(tokens, BS), max_tokens)


PROMPT = list(range(160))  # 10 blocks


def test_goes_to_worker_holding_prefix():
    c = make()
    c.blocks_stored("p1", block_hashes(PROMPT, BS)[:8])
    d = c.place(req("r1", PROMPT))
    assert (d.kind, d.prefill, d.decode, d.cached_tokens) == ("disaggregated", "p1", "d0", 128)
    assert d.ttft_s == pytest.approx(0.032)


def test_queue_outweighs_prefix():
    c = make()
    c.blocks_stored("p1", block_hashes(PROMPT, BS)[:8])
    c.place(req("long", list(range(1000, 1200))))  # 200 new tokens queued on p0 (both empty: p0 by name)
    assert c.workers["p0"].queued_prefill_tokens() == 200
    c.workers["p1"].prefills, c.workers["p0"].prefills = c.workers["p0"].prefills, {}
    # p1 now has 0.2 s queued: 0.2 + 0.032 > p0's 0.160
    d = c.place(req("r1", PROMPT))
    assert (d.prefill, d.cached_tokens) == ("p0", 0)
    assert d.ttft_s == pytest.approx(0.160)


def test_whole_prompt_cached_still_computes_last_token():
    c = make()
    c.blocks_stored("p0", block_hashes(PROMPT, BS))
    d = c.place(req("r", PROMPT))
    assert d.prefill == "p0" and d.cached_tokens == 159


def test_pool_prefix_fetched_when_cheaper():
    c = make()
    c.blocks_stored("pool", block_hashes(PROMPT, BS)[:8])
    c.blocks_stored("p1", block_hashes(PROMPT, BS)[:2])
    d = c.place(req("r", PROMPT))
    # loading pooled blocks (1 us/token) beats computing them (1 ms/token); p1 needs 6 blocks, p0 all 8
    assert (d.prefill, d.cached_tokens, d.fetch_tokens) == ("p1", 128, 96)
    assert d.ttft_s == pytest.approx(0.032 + 96 * 1000 / 1e9)


def test_decode_lowest_predicted_tpot_that_fits():
    c = make(n_d=2)
    for i in range(3):
        c.place(req(f"x{i}", [7] * 20))  # d0 (by name), then the emptier one each time
    assert sorted(len(c.workers[d].decodes) for d in ("d0", "d1")) == [1, 2]
    busy = "d0" if len(c.workers["d0"].decodes) == 2 else "d1"
    free = "d1" if busy == "d0" else "d0"
    assert c.place(req("r", PROMPT)).decode == free
    c.workers[free].kv_capacity_tokens = 100  # prompt + max_tokens = 168 does not fit there any more
    assert c.place(req("r2", PROMPT)).decode == busy


def test_decode_local_by_threshold():
    c = make(local_prefill_tokens=64)
    d = c.place(req("short", list(range(40))))
    assert (d.kind, d.prefill, d.decode) == ("local", None, "d0")
    assert c.workers["d0"].queued_prefill_tokens() == 40
    d = c.place(req("long", PROMPT))
    assert d.kind == "disaggregated"


def test_decode_local_learned_from_costs():
    c = make(local_prefill_tokens=None, local_stall_s=0.05)
    # D idle: computing locally beats P + 50 ms hand-off
    assert c.place(req("a", list(range(300)))).kind == "local"
    c.prefill_done("a")  # now D runs one decode: local prefills must fit the 50 ms stall budget
    assert c.place(req("b", list(range(1000, 1040)))).kind == "local"  # 40 ms
    c.prefill_done("b")
    d = c.place(req("c", list(range(2000, 2100))))  # 100 ms would stall D's decodes
    assert d.kind == "disaggregated"


def test_reject_when_ttft_target_impossible():
    c = make(ttft_slo_s=0.1)
    d = c.place(req("big", list(range(1000))))
    assert d.kind == "reject" and d.retry_after_s == 1.0 and "TTFT" in d.reason
    assert c.in_flight() == 0 and c.workers["p0"].prefills == {}  # nothing reserved
    ok = c.place(req("small", list(range(50))))
    assert ok.kind == "disaggregated"


def test_reject_on_tpot_uses_decode_load_at_prefill_end():
    c = make(tpot_slo_s=0.0125)  # allows a batch of 2: 10 + 1*2 = 12 ms
    c.place(req("a", list(range(20)), max_tokens=1000))
    c.prefill_done("a")
    d = c.place(req("b", list(range(20)), max_tokens=10))
    assert d.kind == "disaggregated" and d.tpot_s == pytest.approx(0.012)
    d = c.place(req("c", list(range(20)), max_tokens=10))
    assert d.kind == "reject" and "TPOT" in d.reason and d.retry_after_s >= 1


def test_membership_and_health():
    c = make()
    c.blocks_stored("p1", block_hashes(PROMPT, BS))
    c.set_health("p1", False)
    assert c.index.blocks_of("p1") == 0  # a worker that went down comes back with an empty cache
    assert c.place(req("a", PROMPT)).prefill == "p0"
    c.remove_worker("p0")
    d = c.place(req("b", PROMPT))  # no live prefill worker: D serves the whole request (degraded)
    assert (d.kind, d.prefill, d.decode) == ("local", None, "d0") and "degraded" in d.reason
    c.set_health("p1", True)
    assert c.place(req("c", PROMPT)).prefill == "p1"
    with pytest.raises(NoWorker) as e:
        c.place(req("e", PROMPT), exclude=frozenset({"p1", "d0"}))
    assert e.value.role == "any"


def test_lifecycle_releases_and_observes():
    clock = Clock()
    c = make(clock=clock)
    c.place(req("a", PROMPT))
    assert c.workers["p0"].queue_s(clock.t) == pytest.approx(0.160)
    clock.t += 0.1
    assert c.workers["p0"].queue_s(clock.t) == pytest.approx(0.060)
    clock.t += 0.1
    c.prefill_done("a")
    assert c.workers["p0"].prefills == {} and c.cost.observations["prefill"] == 1
    for n in range(1, 6):
        clock.t += 0.02
        c.decode_progress("a", n)
    assert c.cost.observations["handoff"] == 1 and c.cost.observations["decode"] == 3
    c.finished("a")
    assert c.in_flight() == 0 and c.workers["d0"].decodes == {}
    c.finished("a")  # idempotent


def test_placement_records_read_through_the_public_api():
    """decision_of / prefill_worker_of follow a request from place to replace_decode to finished; record holds a
    placement (a move's, with its prefill first in the queue) as place does."""
    c = make(n_d=2)
    assert c.decision_of("a") is None and c.prefill_worker_of("a") is None
    d = c.place(req("a", PROMPT))
    assert c.decision_of("a") == d and c.prefill_worker_of("a") == d.prefill
    c.replace_decode("a")
    assert c.decision_of("a") == d and c.prefill_worker_of("a") == d.prefill  # the decision stays; only D moved
    c.place(req("b", PROMPT))
    c.finished("a")
    assert c.decision_of("a") is None and c.prefill_worker_of("a") is None
    pb = c.prefill_worker_of("b")
    assert pb is not None
    tail = Decision("disaggregated", "a", pb, "d1", cached_tokens=150)
    c.record(tail, PrefillJob("a", 10, 150, 0.01, c.clock()), DecodeJob("a", 160, 5, 165), first=True)
    assert list(c.workers[pb].prefills) == ["a", "b"] and "a" in c.workers["d1"].decodes
    assert c.decision_of("a") == tail and c.prefill_worker_of("a") == pb and c.in_flight() == 2


def test_baselines():
    c = make(policy="round_robin")
    c.blocks_stored("p1", block_hashes(PROMPT, BS))
    assert [c.place(req(f"r{i}", PROMPT)).prefill for i in range(4)] == ["p0", "p1", "p0", "p1"]
    c = make(policy="least_loaded")
    c.place(req("big", list(range(500))))  # p0
    assert c.place(req("r", PROMPT)).prefill == "p1"


def test_colocated_workers_get_whole_requests_by_prefix():
    c = Conductor(ConductorConfig(block_size=BS), cost(), Clock())
    c.add_worker("w0", "colocated", 0)
    c.add_worker("w1", "colocated", 0)
    c.blocks_stored("w1", block_hashes(PROMPT, BS))
    d = c.place(req("r", PROMPT))
    assert (d.kind, d.decode, d.prefill) == ("local", "w1", None)


def test_config_errors_say_how_to_fix():
    with pytest.raises(ConductorConfigError, match="round_robin"):
        ConductorConfig(policy="random")
    with pytest.raises(ConductorConfigError, match="128"):
        ConductorConfig(block_size=0)
    with pytest.raises(ConductorConfigError, match="seconds"):
        ConductorConfig(ttft_slo_s=0)


def test_cost_model_fits_and_stays_monotone():
    m = OnlineCostModel(1000)
    for n in (100, 200, 400, 800, 1600, 100, 300, 900):
        m.observe_prefill(n, 0, 0.01 + 0.0005 * n)
    assert m.prefill_s(1000, 0) == pytest.approx(0.51, rel=1e-3)
    assert m.prefill_s(2000, 0) > m.prefill_s(1000, 0) > m.prefill_s(10, 0) > 0
    for b in (1, 2, 4, 8, 1, 3, 5, 7):
        m.observe_decode_step(b, 100 * b, 0.02 + 0.002 * b)
    assert m.decode_step_s(4, 400) == pytest.approx(0.028, rel=1e-2)
    m2 = OnlineCostModel(1000)
    for n in (100, 200, 300, 400, 500, 600):
        m2.observe_prefill(n, 0, 1.0 - n / 1000)  # nonsense data that would fit a negative slope
    assert m2.prefill_s(600, 0) >= m2.prefill_s(100, 0) >= 0
