"""Metric definitions against hand-computed examples; verdicts, crossovers and configuration names."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.client import _consume_line
from pdserve.bench.metrics import SLO, RequestRecord, counter_phases, percentiles, phase_summary, summarize
from pdserve.bench.prom import parse
from pdserve.bench.report import crossover, verdict, write_report
from pdserve.bench.runner import cut_sessions
from pdserve.bench.workload import Session, Turn


def rec(start, first, end, tokens, chunks=None, ok=True, timings=None):
    return RequestRecord(ok=ok, start=start, first_token=first, end=end, output_tokens=tokens,
                         chunk_times=chunks or [], timings=timings)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = rec(10.0, 10.5, 12.5, 5)  # 2 s after the first token for 4 more tokens
    assert r.ttft_s == pytest.approx(0.5)
    assert r.latency_s == pytest.approx(2.5)
    assert r.tpot_s == pytest.approx(0.5)
    assert rec(0.0, 0.2, 0.2, 1).tpot_s is None  # one token: no TPOT
    assert rec(0.0, 0.2, 0.9, 3, ok=False).tpot_s is None


def test_itl_are_gaps_between_chunks():
    assert rec(0, 1.0, 1.6, 3, [1.0, 1.25, 1.6]).itls_s == pytest.approx([0.25, 0.35])


def test_handoff_gap_is_first_to_second_chunk_beside_tpot():
    # a PD answer: P's token at 1.0 s, D's first at 1.3 s (the hand-off), then 50 ms a token
    pd = rec(0, 1.0, 1.45, 5, [1.0, 1.3, 1.35, 1.4, 1.45])
    assert pd.handoff_gap_s == pytest.approx(0.3) and pd.tpot_s == pytest.approx(0.1125)
    assert rec(0, 1.0, 1.0, 1, [1.0]).handoff_gap_s is None  # one chunk: no gap
    assert rec(0, 1.0, 1.3, 2, [1.0, 1.3], ok=False).handoff_gap_s is None
    colocated = [rec(0, 0.5, 0.5 + 0.05 * 4, 5, [0.5 + 0.05 * i for i in range(5)]) for _ in range(3)]
    gaps = [rec(0, 1.0, 2.0, 5, [1.0, 1.0 + g, 1.5, 1.8, 2.0]) for g in (0.1, 0.2, 0.3, 0.4)]
    s = summarize(gaps + [rec(0, 0.2, 0.2, 1, [0.2])], wall_s=2.0)
    assert s["handoff_gap_p50_ms"] == pytest.approx(250.0) and s["handoff_gap_mean_ms"] == pytest.approx(250.0)
    assert s["handoff_gap_p99_ms"] == pytest.approx(397.0)  # rank 2.97 -> 0.3 + 0.97 * 0.1
    assert s["handoff_gap_over_tpot_p50"] == pytest.approx(1.0)  # TPOT 250 ms each
    c = summarize(colocated, wall_s=1.0)
    assert c["handoff_gap_p50_ms"] == pytest.approx(50.0) and c["handoff_gap_over_tpot_p50"] == pytest.approx(1.0)
    assert summarize([rec(0, 0.2, 0.2, 1, [0.2])], 1.0)["handoff_gap_p50_ms"] is None


def test_percentiles_interpolate_linearly():
    p = percentiles([1, 2, 3, 4, None, 5, 6, 7, 8, 9, 10])
    assert p[50] == pytest.approx(5.5)
    assert p[90] == pytest.approx(9.1)  # rank 0.9 * 9 = 8.1 -> 9 + 0.1 * (10 - 9)
    assert p[99] == pytest.approx(9.91)
    assert percentiles([None]) == {50: None, 90: None, 99: None}


def test_summary_and_goodput_by_hand():
    records = [
        rec(0.0, 0.1, 1.1, 11),   # TTFT 100 ms, TPOT 100 ms
        rec(0.0, 0.3, 0.8, 11),   # TTFT 300 ms, TPOT 50 ms
        rec(0.0, 0.2, 0.2, 1),    # TTFT 200 ms, no TPOT: meets any TPOT target
        rec(0.0, 0.1, 2.1, 5),    # TTFT 100 ms, TPOT 500 ms
        rec(0.0, None, None, 0, ok=False),
    ]
    s = summarize(records, wall_s=2.0, slo=SLO(ttft_ms=250, tpot_ms=120))
    assert s["requests"] == 5 and s["errors"] == 1
    assert s["ttft_p50_ms"] == pytest.approx(150.0)
    assert s["ttft_mean_ms"] == pytest.approx(175.0)
    assert s["tpot_mean_ms"] == pytest.approx(650 / 3, abs=0.01)
    assert s["tpot_p50_ms"] == pytest.approx(100.0)
    assert s["e2e_p90_ms"] == pytest.approx(1800.0)  # 200, 800, 1100, 2100: rank 2.7 -> 1100 + 0.7 * 1000
    assert s["req_per_s"] == pytest.approx(2.0)
    assert s["output_tok_per_s"] == pytest.approx(14.0)
    # met: #1 (100 ms, 100 ms) and #3 (200 ms, none); #2 misses TTFT, #4 misses TPOT, #5 failed
    assert s["goodput_req_per_s"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(0.4)
    assert summarize(records, 2.0, SLO(ttft_ms=1000))["goodput_req_per_s"] == pytest.approx(2.0)


def test_phase_summary_from_router_timings():
    t = [{"mode": "disaggregated", "queue_ms": 1.0, "prefill_ms": 100.0, "kv_transfer_ms": 10.0, "ttft_ms": 200.0,
          "handoff_ms": 30.0, "kv_transfer_bytes": 1000},
         {"mode": "disaggregated", "queue_ms": 3.0, "prefill_ms": 300.0, "kv_transfer_ms": 30.0, "ttft_ms": 300.0,
          "handoff_ms": 50.0, "kv_transfer_bytes": 3000}]
    s = phase_summary([rec(0, 0.1, 1, 2, timings=x) for x in t] + [rec(0, 0.1, 1, 2)])
    assert s["timed_requests"] == 2 and s["modes"] == {"disaggregated": 2}
    assert s["prefill_p50_ms"] == 200.0 and s["queue_mean_ms"] == 2.0 and s["kv_transfer_bytes_p50"] == 2000
    assert s["transfer_share_p50"] == pytest.approx((0.05 + 0.1) / 2)
    assert phase_summary([rec(0, 0.1, 1, 2)]) == {}


def test_counter_phases_and_prometheus_parsing():
    text = ('# HELP x\nvllm:pdserve_kv_reads_total 4\nvllm:pdserve_kv_read_seconds_sum 0.02\n'
            'vllm:pdserve_kv_read_bytes_total{a="1"} 400\nvllm:pdserve_kv_read_bytes_total{a="2"} 400\n'
            'pdserve_router_handoffs_total{outcome="kv"} 3\n')
    kv = parse(text, "vllm:pdserve_kv_")
    assert kv["vllm:pdserve_kv_read_bytes_total"] == 800
    router = parse(text, "pdserve_router_handoffs_total", labels=True)
    out = counter_phases(kv, router, ttft_p50_ms=50.0, handoff_p50_ms=10.0)
    assert out["kv_reads"] == 4 and out["kv_read_mean_ms"] == pytest.approx(5.0)
    assert out["kv_read_mean_bytes"] == 200 and out["kv_read_share_of_ttft_p50"] == pytest.approx(0.1)
    assert out["kv_read_share_of_handoff_p50"] == pytest.approx(0.5)
    assert out['handoffs_total{outcome="kv"}'] == 3


def test_stream_parsing_records_chunks_usage_and_timings():
    r = RequestRecord(ok=False, start=0.0)
    _consume_line(r, 'data: {"choices": [{"text": ""}]}', 0.5)
    _consume_line(r, 'data: {"choices": [{"text": "a"}]}', 1.0)
    _consume_line(r, 'data: {"choices": [{"text": "b"}]}', 1.5)
    _consume_line(r, 'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2},'
                  ' "pdserve_timings": {"mode": "colocated"}}', 1.6)
    _consume_line(r, "data: [DONE]", 1.7)
    assert r.first_token == 1.0 and r.chunk_times == [1.0, 1.5]
    assert r.output_tokens == 2 and r.prompt_tokens == 7 and r.timings == {"mode": "colocated"}


def test_cut_sessions_keeps_whole_sessions():
    ss = [Session(i, 0.0, [Turn([1], 1)] * n) for i, n in enumerate([2, 3, 1])]
    kept, left = cut_sessions(ss, 5)
    assert [s.index for s in kept] == [0, 1] and left == 1
    assert cut_sessions(ss, None) == (ss, 0)


def test_crossover_interpolates():
    assert crossover([1, 2, 3], [0.5, 0.9, 1.3]) == pytest.approx(2.25)
    assert crossover([1, 2, 3], [1.5, 1.2, 0.6]) == pytest.approx(2 + 0.2 / 0.6, abs=1e-3)
    assert crossover([1, 2], [0.5, 0.7]) is None


def _results(goodputs, tpots):
    wl = lambda g, t: {"goodput_req_per_s": g, "tpot_p99_ms": t, "ttft_p50_ms": 100.0, "errors": 0}  # noqa: E731
    return {"order": ["colocated2", "1p1d"], "workloads": ["w@1", "w@2"], "slo": {"ttft_ms": 1, "tpot_ms": 1},
            "cores": [0, 1],
            "configs": {c: {"startup_s": 1.0, "workers": 2,
                            "workloads": {f"w@{r}": wl(goodputs[c][i], tpots[c][i]) for i, r in enumerate((1, 2))}}
                        for c in ("colocated2", "1p1d")}}


def test_verdict_and_report_files(tmp_path):
    res = _results({"colocated2": [1.0, 1.0], "1p1d": [0.8, 1.5]}, {"colocated2": [50, 200], "1p1d": [80, 40]})
    v = verdict(res, "w@2")
    assert v["winner"] == "1p1d" and v["goodput_ratio"] == 1.5 and v["tpot_p99_ratio"] == 0.2
    assert verdict(res, "w@1")["winner"] == "colocated2"
    out = write_report(res, tmp_path, command="pdserve bench compare ...", plots=False)
    assert out["crossovers"][0]["goodput_crossover_rate"] == pytest.approx(1.0 + 0.2 / 0.7, abs=1e-3)
    md = (tmp_path / "report.md").read_text()
    assert "**1p1d** wins over colocated2: goodput 1.50x" in md
    assert json.loads((tmp_path / "results.json").read_text())["verdicts"][1]["winner"] == "1p1d"
    # ties on goodput go to the lower TPOT p99
    tie = _results({"colocated2": [1.0, 1.0], "1p1d": [1.0, 1.0]}, {"colocated2": [50, 50], "1p1d": [40, 60]})
    assert verdict(tie, "w@1")["winner"] == "1p1d" and verdict(tie, "w@2")["winner"] == "colocated2"


def test_records_round_trip_and_rescore(tmp_path):
    from pdserve.bench.metrics import record_from_dict
    from pdserve.bench.report import rescore

    r = rec(10.0, 10.2, 11.2, 3, [10.2, 10.7, 11.2])
    back = record_from_dict(r.to_dict(t0=10.0))
    assert back.ttft_s == pytest.approx(0.2) and back.tpot_s == pytest.approx(0.5)
    assert back.itls_s == pytest.approx([0.5, 0.5])
    res = _results({"colocated2": [0, 0], "1p1d": [0, 0]}, {"colocated2": [1, 1], "1p1d": [1, 1]})
    (tmp_path / "src" / "raw").mkdir(parents=True)
    fast, slow = rec(0, 0.1, 0.5, 5).to_dict(), rec(0, 3.0, 3.4, 5).to_dict()
    for c, recs in (("colocated2", [fast, slow]), ("1p1d", [fast, fast])):
        for label in res["workloads"]:
            (tmp_path / "src" / "raw" / f"{c}__{label}.json").write_text(json.dumps({"wall_s": 2.0, "records": recs}))
    (tmp_path / "src" / "results.json").write_text(json.dumps(res))
    out = rescore(tmp_path / "src", tmp_path / "new", slo_ttft_ms=1000, slo_tpot_ms=None)
    assert out["verdicts"][0]["winner"] == "1p1d" and out["verdicts"][0]["goodput_ratio"] == 2.0
    assert (tmp_path / "new" / "report.md").is_file()
