"""pdserve.bench.matrix: hand-off percentiles of split requests, the load-average sampler, issue 16's goal ratios."""

from __future__ import annotations

import pytest

from pdserve.bench.matrix import (
    LoadSampler,
    best_by_goodput,
    cpu_busy,
    elastic_goals,
    handoff_stats,
    parse_loadavg,
    parse_proc_stat,
    wait_for_quiet,
)
from pdserve.bench.metrics import RequestRecord


def _rec(handoff: float | None, ok: bool = True, timed: bool = True) -> RequestRecord:
    timings = {"mode": "disaggregated" if handoff is not None else "local", "handoff_ms": handoff} if timed else None
    return RequestRecord(ok=ok, start=0.0, first_token=0.1, end=1.0, output_tokens=4, timings=timings)


def test_handoff_stats_only_split_successful_requests() -> None:
    recs = [_rec(10.0), _rec(20.0), _rec(30.0), _rec(None), _rec(500.0, ok=False), _rec(None, timed=False)]
    got = handoff_stats(recs)
    assert got["timed_requests"] == 4
    assert got["split_requests"] == 3
    assert got["handoff_p50_ms"] == 20.0
    assert got["handoff_p99_ms"] == pytest.approx(29.8)


def test_handoff_stats_none_split() -> None:
    got = handoff_stats([_rec(None), _rec(None)])
    assert got == {"timed_requests": 2, "split_requests": 0, "handoff_p50_ms": None, "handoff_p99_ms": None}


def test_parse_loadavg() -> None:
    assert parse_loadavg("2.35 1.83 1.81 5/168 5553\n") == 2.35
    with pytest.raises(ValueError, match="loadavg"):
        parse_loadavg("")


def test_load_sampler_window_and_series() -> None:
    now = [0.0]
    values = iter(["1.0 0 0 1/1 1", "2.0 0 0 1/1 1", "garbage", "4.0 0 0 1/1 1"])
    s = LoadSampler(period_s=3600.0, read=lambda: next(values), clock=lambda: now[0])
    for t in (0.0, 10.0, 20.0, 40.0):
        now[0] = t
        s.sample()
    assert s.samples == [(0.0, 1.0), (10.0, 2.0), (40.0, 4.0)]  # the unreadable line is skipped
    assert s.window(5.0, 45.0) == {"load1_mean": 3.0, "load1_max": 4.0, "load_samples": 2}
    assert s.window(50.0, 60.0) == {"load1_mean": None, "load1_max": None, "load_samples": 0}
    assert s.series(every_s=30.0) == [(0.0, 1.0), (40.0, 4.0)]


def test_load_sampler_thread_samples_at_enter_and_exit() -> None:
    with LoadSampler(period_s=3600.0, read=lambda: "0.5 0 0 1/1 1") as s:
        pass
    assert [v for _, v in s.samples] == [0.5, 0.5]


def _r(goodput: float, ttft50: float, tpot99: float) -> dict[str, float]:
    return {"goodput_req_per_s": goodput, "ttft_p50_ms": ttft50, "tpot_p99_ms": tpot99}


RESULTS = {
    "colocated1": {"mixed": _r(0.5, 1000, 400), "short": _r(0.9, 100, 50)},
    "colocated2": {"mixed": _r(0.4, 1500, 800), "short": _r(1.0, 90, 40)},
    "1p1d": {"mixed": _r(0.3, 9000, 100), "short": _r(0.95, 120, 30)},
    "elastic2": {"mixed": _r(0.65, 1400, 180), "short": _r(0.94, 110, 45)},
}


def test_best_by_goodput_ties_go_to_lower_tpot_p99() -> None:
    res = {"a": {"w": _r(1.0, 1, 90)}, "b": {"w": _r(1.0, 1, 50)}, "c": {"w": _r(0.5, 1, 10)}}
    assert best_by_goodput(res, ["a", "b", "c"], "w") == "b"
    assert best_by_goodput(res, ["a"], "missing") is None


def test_elastic_goals_exact_ratios() -> None:
    g = elastic_goals(RESULTS, "elastic2", "mixed", ["colocated1", "colocated2"], ["colocated2", "1p1d"])
    mixed = g["mixed_vs_best_colocated"]
    assert mixed["baseline"] == "colocated1"
    assert mixed["tpot_p99_ms"] == {"ratio": 0.45, "bound": 0.5, "sense": "max", "met": True}
    assert mixed["ttft_p50_ms"] == {"ratio": 1.4, "bound": 1.5, "sense": "max", "met": True}
    assert mixed["goodput_req_per_s"] == {"ratio": 1.3, "bound": 1.2, "sense": "min", "met": True}
    fixed = g["goodput_vs_better_fixed"]
    assert fixed["mixed"] == {"baseline": "colocated2", "goodput_ratio": 1.625, "bound": 0.95, "met": True}
    assert fixed["short"] == {"baseline": "colocated2", "goodput_ratio": 0.94, "bound": 0.95, "met": False}
    assert g["all_met"] is False


def test_elastic_goals_missing_figures_are_unknown_not_met() -> None:
    res = {"colocated1": {"mixed": _r(0.5, 1000, 400)}, "elastic2": {"mixed": _r(0.5, None, 100)}}
    g = elastic_goals(res, "elastic2", "mixed", ["colocated1"], [])
    assert g["mixed_vs_best_colocated"]["ttft_p50_ms"] == {"ratio": None, "bound": 1.5, "sense": "max", "met": None}
    assert g["mixed_vs_best_colocated"]["tpot_p99_ms"]["ratio"] == 0.25
    assert g["goodput_vs_better_fixed"]["mixed"] == {"baseline": None, "goodput_ratio": None, "bound": 0.95,
                                                     "met": None}
    assert g["all_met"] is None


@pytest.mark.parametrize(("elastic", "base", "gain_met", "floor_met"),
                         [(0.3, 0.0, True, True), (0.0, 0.0, False, True), (0.0, 0.2, False, False)])
def test_elastic_goals_zero_goodput_baseline(elastic: float, base: float, gain_met: bool, floor_met: bool) -> None:
    res = {"colocated1": {"mixed": _r(base, 1000, 400)}, "1p1d": {"mixed": _r(base, 1000, 400)},
           "elastic2": {"mixed": _r(elastic, 1000, 100)}}
    g = elastic_goals(res, "elastic2", "mixed", ["colocated1"], ["1p1d"])
    assert g["mixed_vs_best_colocated"]["goodput_req_per_s"]["met"] is gain_met
    assert g["goodput_vs_better_fixed"]["mixed"]["met"] is floor_met


STAT = "cpu  {u} 0 {s} {i} {w} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1\n"


def test_parse_proc_stat_and_cpu_busy() -> None:
    assert parse_proc_stat(STAT.format(u=10, s=5, i=80, w=5)) == (15.0, 100.0)
    with pytest.raises(ValueError, match="cpu"):
        parse_proc_stat("intr 1\n")
    reads = iter([STAT.format(u=10, s=5, i=80, w=5), STAT.format(u=70, s=15, i=110, w=5)])
    assert cpu_busy(1.0, read=lambda: next(reads), sleep=lambda s: None) == pytest.approx(70 / 100)


def test_wait_for_quiet_stops_when_quiet_or_at_the_bound() -> None:
    now = [0.0]

    def busy_seq(vals: list[float]):  # type: ignore[no-untyped-def]
        it = iter(vals)

        def f() -> float:
            now[0] += 3.0
            return next(it)
        return f

    got = wait_for_quiet(0.4, 60.0, busy=busy_seq([0.9, 0.8, 0.3]), clock=lambda: now[0])
    assert got == {"quiet_wait_s": 9.0, "busy_at_start": 0.3, "quiet": True}
    now[0] = 0.0
    got = wait_for_quiet(0.4, 5.0, busy=busy_seq([0.9, 0.9, 0.9]), clock=lambda: now[0])
    assert got == {"quiet_wait_s": 6.0, "busy_at_start": 0.9, "quiet": False}
