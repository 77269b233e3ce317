"""False refusals (pdserve/conductor/refusal_replay.py): each early rejection judged by the measured requests placed
on the same worker at the same moment, only where a bound proves it; bounded; and wired into the router's placement,
decision record and metrics."""

from __future__ import annotations

from pdserve.conductor.refusal_replay import Neighbour, Refusal, RefusalReplay


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def refusal(rid: str, at: float, target: str = "ttft", new: int = 500, target_s: float = 1.0) -> Refusal:
    return Refusal(rid, at, target, target_s, "P", new, new, new + 16)


def neighbour(at: float, new: int = 500, decodes: str = "D", ctx: int = 516) -> Neighbour:
    return Neighbour(at, "P", decodes, new, new, ctx)


def setup() -> tuple[Clock, RefusalReplay, list]:
    clock = Clock()
    r = RefusalReplay(clock, window_s=2.0, horizon_s=60.0)
    seen: list = []
    r.on_verdict.append(lambda rid, v: seen.append((rid, v.verdict, v.bound_s, v.by)))
    return clock, r, seen


def test_a_later_request_with_more_work_that_met_the_target_makes_the_refusal_false():
    clock, r, seen = setup()
    r.refused(refusal("x", 100.0))
    r.placed("n", neighbour(100.5, new=600))  # half a second later, more tokens to compute
    clock.t = 103.0
    r.resolve()
    assert seen == []  # its neighbour has not closed: no verdict yet
    r.closed("n", 0.4, 0.05)  # first token 0.9 s after the refusal at the latest: within 1 s
    assert seen == [("x", "false_refusal", 0.9, "n")]
    assert r.counts == {("ttft", "false_refusal"): 1} and r.share() == 1.0


def test_an_earlier_request_that_missed_proves_the_refusal_right_whatever_its_size():
    clock, r, seen = setup()
    r.placed("a", neighbour(99.0, new=10))  # ahead of the refused request in the queue
    r.refused(refusal("x", 100.0))
    clock.t = 103.0
    r.closed("a", 2.5, None)  # its first token 1.5 s after the refusal: the refused one's no sooner
    assert seen == [("x", "right", 1.5, "a")]
    assert r.share() == 0.0


def test_no_bound_decides_unverified():
    clock, r, seen = setup()
    r.placed("early", neighbour(99.5))  # ahead of it, but done 0.5 s after the refusal: proves nothing
    r.refused(refusal("x", 100.0))
    r.placed("small", neighbour(100.5, new=100))  # met the target but had less to compute: proves nothing
    r.placed("far", neighbour(105.0, new=900))  # outside the window
    r.placed("other", Neighbour(100.2, "P2", "D", 900, 900, 916))  # another worker's queue
    clock.t = 110.0
    for rid in ("small", "early", "far", "other"):
        r.closed(rid, 0.2 if rid != "early" else 1.0, None)
    assert seen == [("x", "unverified", None, "")]
    assert r.share() is None  # unverified ones are never in the share


def test_tpot_refusals_judged_by_the_batch_beside_them_and_kv_never():
    clock, r, seen = setup()
    r.placed("n", neighbour(99.5, new=100, ctx=800))
    r.refused(Refusal("t", 100.0, "tpot", 0.05, "D", 100, 100, 600))
    r.refused(Refusal("k", 100.0, "kv", 0.0, "D", 100, 100, 600))
    clock.t = 103.0
    r.closed("n", 0.3, 0.04)
    assert sorted(seen) == [("k", "unverified", None, ""), ("t", "false_refusal", 0.04, "n")]


def test_bounded_pending_and_horizon():
    clock = Clock()
    r = RefusalReplay(clock, window_s=2.0, horizon_s=10.0, max_pending=2, max_placed=3)
    r.placed("open", neighbour(100.5, new=900))  # never closes
    for i in range(3):
        r.refused(refusal(f"x{i}", 100.0))
    assert r.pending() == 2 and r.counts == {("ttft", "unverified"): 1}  # the oldest gave way
    clock.t = 111.0  # past the horizon: its neighbour never closed, no verdict
    r.resolve()
    assert r.pending() == 0 and r.counts == {("ttft", "unverified"): 3}
    r.refused(refusal("y", 111.0))
    for i in range(5):  # only the newest max_placed placements are kept: p0 and p1 are forgotten
        r.placed(f"p{i}", neighbour(111.1 + i / 10, new=900))
    clock.t = 114.0
    for i in range(5):
        r.closed(f"p{i}", 0.1, None)
    assert r.pending() == 1  # p0 and p1 never report: y waits for them up to the horizon ...
    clock.t = 121.5
    r.resolve()  # ... then is judged on the neighbours that closed: p2, placed 0.3 s after it, first token 0.1 s later
    assert r.counts[("ttft", "false_refusal")] == 1 and r.pending() == 0


def test_the_router_judges_its_rejections_in_the_record_the_metrics_and_the_dashboard():
    import pytest

    from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
    from pdserve.prom import families
    from pdserve.router.endpoints.dashboard import refusals_view, samples
    from pdserve.router.errors import RouterError
    from pdserve.router.fleet.placement import ConductorPlacement
    from pdserve.router.fleet.registry import WorkerRegistry
    from pdserve.router.metrics import ConductorCollector, RouterMetrics

    clock = Clock()
    conductor = Conductor(ConductorConfig(block_size=4, local_prefill_tokens=0, ttft_slo_s=1.0),
                          OnlineCostModel(1000), clock)
    placement = ConductorPlacement(conductor, WorkerRegistry((("prefill", "http://p0"), ("decode", "http://d0"))),
                                   clock=clock)
    metrics = RouterMetrics()
    metrics.registry.register(ConductorCollector(placement))
    first = placement.choose(list(range(1, 401)), request_id="a", max_tokens=4)  # ~0.18 s predicted: placed
    blocked = [placement.choose(list(range(1000, 2200)), request_id="q", max_tokens=4)]  # a long one queued next
    with pytest.raises(RouterError) as e:  # predicted TTFT over 1 s: the early rejection
        placement.choose(list(range(9000, 9800)), request_id="x", max_tokens=4)
    assert e.value.status == 429
    clock.t += 0.5
    later = placement.choose(list(range(20000, 20900)), request_id="b", max_tokens=4)  # part of the queue done: placed
    assert later.decision.kind == "disaggregated"
    for t in (first, *blocked):  # placed before x: ahead of it, done 0.5 s after it (within the target)
        t.progress(1, clock.t)
        t.close()
    clock.t += 0.2  # b's first token 0.2 s after it was placed: 0.7 s after x's refusal, more work than x
    later.progress(1, clock.t)
    later.close()
    clock.t += 5.0
    metrics.render()  # a scrape judges what is due
    rec = placement.decisions.get("x")
    assert rec is not None and rec["placements"][0]["replay"]["verdict"] == "false_refusal"
    assert rec["placements"][0]["replay"]["by"] == "b"
    got = {(s.labels["target"], s.labels["verdict"]): s.value for _, _, ss in families(metrics.render()) for s in ss
           if s.name == "pdserve_conductor_refusal_verdicts_total"}
    assert got == {("ttft", "false_refusal"): 1.0}
    assert refusals_view(samples(metrics.registry)) == {"false_refusal": 1, "false_refusal_ratio": 1.0}
