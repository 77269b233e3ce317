"""The decision record ring: bounded, a request's placements in order (first, migration, move), rejections, the
choices of an ``n`` request under its id, and one record in ``log_every`` logged."""

from __future__ import annotations

import logging

from pdserve.conductor import Decision
from pdserve.conductor.decision import Candidate
from pdserve.router.fleet.decision_log import DecisionLog
from pdserve.router.fleet.prediction_error import Measured

PD = Decision("disaggregated", "r", "http://p0", "http://d0", ttft_s=0.2, tpot_s=0.05, reason="lowest predicted TTFT",
              cached_tokens=32, fetch_tokens=16, fetch_tier="pool",
              candidates=(Candidate("http://p0", "prefill", 0.2, 32, 16, "pool"), Candidate("http://d0", "decode", 0.05)))


def test_placements_in_order_with_prefix_hits_and_measurements():
    log = DecisionLog()
    log.closed("r", "conductor", PD, frozenset(), Measured(0.3, 0.04), moved=False)
    local = Decision("local", "r", None, "http://d1", ttft_s=0.1, reason="no prefill worker")
    log.closed("r", "conductor", local, frozenset({"http://p0"}), Measured(None, None), moved=False)
    log.closed("r", "conductor", PD, frozenset(), Measured(0.01, None), moved=True)
    rec = log.get("r")
    assert rec is not None
    first, migration, move = rec["placements"]
    assert first["why"] == "first" and first["rule"] == "lowest predicted TTFT"
    assert first["prefix_hit"] == {"cached_tokens": 32, "fetch_tokens": 16, "fetch_tier": "pool"}
    assert first["predicted"] == {"ttft_s": 0.2, "tpot_s": 0.05} and first["measured"] == {"ttft_s": 0.3,
                                                                                             "tpot_s": 0.04}
    assert first["candidates"] == [
        {"worker": "http://p0", "role": "prefill", "predicted_s": 0.2, "cached_tokens": 32, "fetch_tokens": 16,
         "fetch_tier": "pool"},
        {"worker": "http://d0", "role": "decode", "predicted_s": 0.05, "cached_tokens": 0, "fetch_tokens": 0,
         "fetch_tier": ""}]
    assert "candidates" not in migration
    assert migration["why"] == "migration" and migration["excluded"] == ["http://p0"]
    assert migration["measured"] == {"ttft_s": None, "tpot_s": None}
    assert move["why"] == "move"


def test_a_rejection_keeps_its_reason():
    log = DecisionLog()
    d = Decision("reject", "r", retry_after_s=3.0, reason="every worker is full", code="worker_limit")
    log.rejected("r", "conductor", d, frozenset())
    (rej,) = log.get("r")["placements"]
    assert rej["kind"] == "reject" and rej["rule"] == "every worker is full"
    assert rej["rejection"] == {"code": "worker_limit", "retry_after_s": 3.0}


def test_the_ring_is_bounded_and_choices_are_found_under_the_request_id():
    log = DecisionLog(capacity=3)
    for rid in ("a", "b-0", "b-1", "c"):
        log.closed(rid, "conductor", PD, frozenset(), Measured(0.1, None), moved=False)
    assert log.get("a") is None  # the oldest went first
    assert [c["request_id"] for c in log.get("b")["choices"]] == ["b-0", "b-1"]
    assert log.get("nothing") is None


def test_one_record_in_log_every_is_logged(caplog):
    log = DecisionLog(log_every=2)
    with caplog.at_level(logging.INFO, "pdserve.router.decisions"):
        for rid in "abcd":
            log.closed(rid, "conductor", PD, frozenset(), Measured(0.1, None), moved=False)
    logged = [r.getMessage() for r in caplog.records if r.name == "pdserve.router.decisions"]
    assert len(logged) == 2 and '"request_id":"b"' in logged[0] and '"request_id":"d"' in logged[1]


def test_each_placement_is_stamped_and_found_by_time_and_newest_first():
    now = [100.0]
    log = DecisionLog(clock=lambda: now[0])
    log.closed("a", "conductor", PD, frozenset(), Measured(0.1, None), moved=False)
    now[0] = 150.0
    log.closed("b", "conductor", PD, frozenset(), Measured(0.1, None), moved=False)
    log.closed("a", "conductor", PD, frozenset(), Measured(None, None), moved=False)  # a's migration, later
    assert [p["at"] for p in log.record("a")["placements"]] == [100.0, 150.0]
    assert [p.get("why") for p in log.placements_since(120.0)] == ["migration", "first"]
    assert [r["request_id"] for r in log.recent(5)] == ["b", "a"] and log.recent(1)[0]["request_id"] == "b"
