"""Predictions that report their own error: a ticket measures its placement's TTFT and TPOT on a fake clock and, on
close, the router's /metrics text holds measured minus predicted, per worker and policy."""

from __future__ import annotations

import pytest

from pdserve.conductor import Conductor, ConductorConfig, Decision, OnlineCostModel
from pdserve.prom import families
from pdserve.router.fleet.placement import ConductorPlacement
from pdserve.router.fleet.prediction_error import Measured, PredictionErrors, ratio
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.fleet.ticket import PlacementTicket
from pdserve.router.metrics import RouterMetrics

from .fake_clock import Clock

MEMBERS = (("prefill", "http://p0"), ("decode", "http://d0"))


def placed(policy: str = "conductor") -> tuple[ConductorPlacement, RouterMetrics, Clock]:
    clock = Clock()
    conductor = Conductor(ConductorConfig(policy=policy, block_size=4, local_prefill_tokens=0),
                          OnlineCostModel(1000), clock)
    placement = ConductorPlacement(conductor, WorkerRegistry(MEMBERS), clock=clock)
    metrics = RouterMetrics()
    placement.errors = PredictionErrors(metrics.registry)
    return placement, metrics, clock


def samples(metrics: RouterMetrics, name: str) -> dict[tuple[str, str], float]:
    """{(worker, policy): value} of ``name``'s samples."""
    return {(s.labels["worker"], s.labels["policy"]): s.value for _, _, ss in families(metrics.render())
            for s in ss if s.name == name}


def bucket_counts(metrics: RouterMetrics, name: str, key: tuple[str, str]) -> list[tuple[str, float]]:
    """[(le, cumulative count)] of histogram ``name`` for (worker, policy) ``key``."""
    return [(s.labels["le"], s.value) for _, _, ss in families(metrics.render()) for s in ss
            if s.name == name + "_bucket" and (s.labels["worker"], s.labels["policy"]) == key]


def test_ratio_is_relative_and_none_without_a_prediction():
    assert ratio(1.5, 1.0) == pytest.approx(1.5)
    assert ratio(0.5, 1.0) == pytest.approx(0.5)
    assert ratio(1.0, 0.0) is None


def test_a_ticket_measures_ttft_from_its_decision_and_tpot_over_later_tokens():
    clock = Clock()
    placement, _, _ = placed()
    d = Decision("disaggregated", "r", "http://p0", "http://d0", ttft_s=0.2, tpot_s=0.05)
    t = PlacementTicket(placement.conductor, placement.registry, d, clock=clock)
    assert t.measured() == Measured(None, None)
    clock.t += 0.3
    t.progress(1, clock.t)
    assert t.measured() == Measured(pytest.approx(0.3), None)
    for n in range(2, 6):
        clock.t += 0.1
        t.progress(n, clock.t)
    assert t.measured() == Measured(pytest.approx(0.3), pytest.approx(0.1))


def test_a_migrated_requests_later_ticket_counts_only_its_own_tokens():
    clock = Clock()
    placement, _, _ = placed()
    d = Decision("local", "r", None, "http://d0", ttft_s=0.1, tpot_s=0.05)
    t = PlacementTicket(placement.conductor, placement.registry, d, clock=clock)
    t.tokens_before = 5
    clock.t += 1.0
    t.progress(5, clock.t)  # the earlier workers' tokens: not this placement's
    assert t.measured() == Measured(None, None)
    clock.t += 0.5
    t.progress(7, clock.t)
    assert t.measured().ttft_s == pytest.approx(1.5)


@pytest.mark.parametrize("policy", ["conductor", "round_robin"])
def test_close_exports_the_error_per_worker_and_policy(policy):
    placement, metrics, clock = placed(policy)
    t = placement.choose(list(range(1, 41)), request_id="r1", max_tokens=8)
    d = t.decision
    assert d.kind == "disaggregated" and d.ttft_s > 0 and d.tpot_s > 0
    clock.t += d.ttft_s * 2  # twice as slow as predicted to the first token ...
    t.progress(1, clock.t)
    for n in range(2, 4):  # ... and exactly as predicted per token after it
        clock.t += d.tpot_s
        t.progress(n, clock.t)
    t.close()
    t.close()  # once only
    key = (d.prefill, policy)
    assert samples(metrics, "pdserve_router_ttft_prediction_error_ratio_sum")[key] == pytest.approx(2.0)
    assert samples(metrics, "pdserve_router_ttft_prediction_error_ratio_count")[key] == 1
    assert d.ttft_s <= 2.5  # the signed error (d.ttft_s) falls in the buckets from the next bound above it
    buckets = {float(le): v for (le, v) in bucket_counts(metrics, "pdserve_router_ttft_prediction_error_seconds",
                                                         key)}
    above = min(b for b in buckets if b >= d.ttft_s - 1e-12)
    assert buckets[above] == 1 and all(v == 0 for b, v in buckets.items() if b < d.ttft_s - 1e-12)
    dkey = (d.decode, policy)
    assert samples(metrics, "pdserve_router_tpot_prediction_error_ratio_sum")[dkey] == pytest.approx(1.0)
    assert samples(metrics, "pdserve_router_tpot_prediction_error_seconds_count")[dkey] == 1


def test_a_ticket_closed_before_any_token_exports_nothing():
    placement, metrics, _ = placed()
    placement.choose(list(range(1, 41)), request_id="r1").close()
    assert samples(metrics, "pdserve_router_ttft_prediction_error_seconds_count") == {}
    assert samples(metrics, "pdserve_router_tpot_prediction_error_seconds_count") == {}


def test_the_conductor_records_every_candidate_it_weighed():
    clock = Clock()
    members = (("prefill", "http://p0"), ("prefill", "http://p1"), ("decode", "http://d0"), ("decode", "http://d1"))
    conductor = Conductor(ConductorConfig(policy="conductor", block_size=4, local_prefill_tokens=0),
                          OnlineCostModel(1000), clock)
    placement = ConductorPlacement(conductor, WorkerRegistry(members), clock=clock)
    placement.choose(list(range(1, 41)), request_id="warm")  # queues one prompt on a prefill worker
    d = placement.choose(list(range(1, 41)), request_id="r1").decision
    by_role = {r: {c.worker: c for c in d.candidates if c.role == r} for r in ("prefill", "decode")}
    assert set(by_role["prefill"]) == {"http://p0", "http://p1"} and set(by_role["decode"]) == {"http://d0",
                                                                                               "http://d1"}
    assert by_role["prefill"][d.prefill].predicted_s == pytest.approx(d.ttft_s)
    assert by_role["decode"][d.decode].predicted_s == pytest.approx(d.tpot_s)
    ttfts = sorted(c.predicted_s for c in by_role["prefill"].values())
    assert ttfts[0] == pytest.approx(d.ttft_s) and ttfts[1] > ttfts[0]  # the busy one predicted slower
