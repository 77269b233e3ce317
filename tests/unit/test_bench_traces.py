"""Mooncake trace loading and scaling, and the synthetic and agent workloads (no servers)."""

from __future__ import annotations

import gzip
import json

import pytest

from pdserve.bench.traces import (
    PACKAGED_TRACE,
    TOKEN_LOW,
    TRACE_ENV,
    TraceError,
    TraceRow,
    TraceScale,
    conversation_rows,
    default_trace,
    load_trace,
    parse_row,
    prompt_ids,
    scale_rows,
    shared_prefix_len,
)
from pdserve.bench.workload import agent_workload, build_workload, parse_spec, synthetic_workload
from pdserve.plan.traffic import load_trace as plan_load_trace

ROWS = [
    {"timestamp": 1000, "input_length": 1200, "output_length": 100, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 3]},
    {"timestamp": 5000, "input_length": 600, "output_length": 50, "hash_ids": [4, 5]},
    {"timestamp": 9000, "input_length": 1536, "output_length": 7, "hash_ids": [0, 1, 2]},
]


@pytest.fixture
def trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    return p


def test_load_and_window(trace):
    rows = load_trace(trace)
    assert rows[0] == TraceRow(1000.0, 1200, 100, (0, 1, 2))
    assert [r.input_length for r in load_trace(trace, start=1, limit=2)] == [1100, 600]


def test_gzipped_trace_reads_like_the_plain_one(trace, tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(trace.read_bytes()))
    assert load_trace(gz) == load_trace(trace)
    assert [r.prompt_tokens for r in plan_load_trace(gz)] == [r.prompt_tokens for r in plan_load_trace(trace)]


def test_default_trace_is_packaged_and_env_overrides_it(trace, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert default_trace() == PACKAGED_TRACE and PACKAGED_TRACE.name.endswith(".jsonl.gz")
    assert (PACKAGED_TRACE.parent / "README.md").is_file()  # source and licence of the shipped trace
    monkeypatch.setenv(TRACE_ENV, str(trace))
    assert default_trace() == trace
    assert load_trace() == load_trace(trace)


def test_packaged_conversation_trace_is_whole(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    rows = load_trace()
    assert len(rows) == 12031  # Mooncake's conversation trace, every row
    assert all(b.timestamp_ms >= a.timestamp_ms for a, b in zip(rows, rows[1:]))


def test_bad_rows_name_the_problem(tmp_path):
    with pytest.raises(TraceError, match="input_length"):
        parse_row({"timestamp": 0, "output_length": 3, "hash_ids": [1]})
    with pytest.raises(TraceError, match="512-token blocks"):
        parse_row({"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2]})
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")


def test_equal_hash_ids_give_equal_prefixes(trace):
    reqs = scale_rows(load_trace(trace), TraceScale())
    p = [prompt_ids(r, 512, 49152) for r in reqs]
    assert [len(x) for x in p] == [1200, 1100, 600, 1536]
    assert shared_prefix_len(p[0], p[1]) == 1024  # blocks 0 and 1 shared, block 2 vs 3 differ at once
    assert p[3][:1200] == p[0]  # same ids: the shorter one's partial last block is a prefix of the longer one
    assert shared_prefix_len(p[0], p[2]) == 0
    assert all(TOKEN_LOW <= t < 49152 for x in p for t in x)
    # deterministic across calls, different under another seed
    assert prompt_ids(reqs[0], 512, 49152) == p[0]
    assert shared_prefix_len(prompt_ids(reqs[0], 512, 49152, seed=1), p[0]) < 5


def test_length_and_time_scaling(trace):
    rows = load_trace(trace)
    s = TraceScale(input_scale=0.25, output_scale=0.5, time_scale=0.5)
    reqs = scale_rows(rows, s)
    assert s.block_tokens == 128
    assert [r.input_length for r in reqs] == [300, 275, 150, 384]
    assert [r.output_length for r in reqs] == [50, 5, 25, 4]  # round(3.5) == 4 (banker's rounding)
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0, 4.0]
    p = [prompt_ids(r, s.block_tokens, 32000) for r in reqs]
    assert shared_prefix_len(p[0], p[1]) == 256  # the sharing structure survives scaling
    assert p[3][:300] == p[0]


def test_rate_rescales_time(trace):
    reqs = scale_rows(load_trace(trace), TraceScale(rate=1.5))
    assert reqs[-1].arrival_s == pytest.approx(3 / 1.5)  # 4 requests, 3 gaps
    assert reqs[1].arrival_s == pytest.approx(2.0 / 8.0 * 2.0)  # relative spacing kept


def test_caps_to_the_model_context(trace):
    reqs = scale_rows(load_trace(trace), TraceScale(max_model_len=1000, max_output=64, max_input=900))
    for r in reqs:
        assert r.input_length + r.output_length <= 1000 and r.output_length <= 64 and r.input_length <= 900
    assert reqs[0].input_length == 900 and reqs[0].output_length == 64
    tiny = scale_rows(load_trace(trace), TraceScale(max_model_len=64))
    assert all(r.input_length + r.output_length <= 64 and r.input_length >= 1 for r in tiny)


def test_scale_validation():
    with pytest.raises(TraceError, match="input_scale"):
        TraceScale(input_scale=0)
    with pytest.raises(TraceError, match="rate"):
        TraceScale(rate=-1)


def test_real_conversation_trace_shares_prefixes(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    wl = build_workload("trace:input_scale=0.1,output_scale=0.1,requests=40,rate=2", vocab_size=49152,
                        max_model_len=2048)
    prompts = [s.turns[0].prompt_ids for s in wl.sessions]
    assert wl.num_requests == 40 and wl.offered_rate == pytest.approx(2.0)
    assert all(len(p) + s.turns[0].max_tokens <= 2048 for p, s in zip(prompts, wl.sessions))
    # rows 0-2 all start with hash id 0: a 51-token shared block
    assert shared_prefix_len(prompts[0], prompts[1]) >= 51


def test_synthetic_rates_and_lengths():
    wl = synthetic_workload(rate=4.0, requests=2000, input=100, output=20, input_dist="uniform", seed=3)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(wl.sessions, wl.sessions[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.08)
    ins = [len(s.turns[0].prompt_ids) for s in wl.sessions]
    assert 50 <= min(ins) and max(ins) <= 150 and sum(ins) / len(ins) == pytest.approx(100, rel=0.05)
    fixed = synthetic_workload(rate=2.0, requests=5, arrival="fixed")
    assert [s.arrival_s for s in fixed.sessions] == [0.0, 0.5, 1.0, 1.5, 2.0]


def test_agent_context_grows_with_each_tool_result():
    wl = agent_workload(sessions=3, turns=4, system=100, user=10, tool=50, output=8)
    for s in wl.sessions:
        lens = [len(t.prompt_ids) for t in s.turns]
        assert lens == [110, 168, 226, 284]
        for a, b in zip(s.turns, s.turns[1:]):
            assert b.prompt_ids[:len(a.prompt_ids)] == a.prompt_ids
    a, b = wl.sessions[0].turns[0].prompt_ids, wl.sessions[1].turns[0].prompt_ids
    assert shared_prefix_len(a, b) >= 100  # the system prompt is shared
    capped = agent_workload(sessions=1, turns=10, system=100, user=10, tool=50, output=8, max_model_len=250)
    assert all(len(t.prompt_ids) + 8 <= 250 for t in capped.sessions[0].turns)


def test_spec_strings():
    assert parse_spec("poisson:rate=2, input=10") == ("poisson", {"rate": "2", "input": "10"})
    wl = build_workload("fixed:rate=10,requests=3,input=5,output=2,concurrency=2")
    assert wl.concurrency == 2 and wl.num_requests == 3
    with pytest.raises(TraceError, match="unknown option"):
        build_workload("poisson:bogus=1")
    with pytest.raises(TraceError, match="kind"):
        parse_spec("zipf:rate=1")
    assert build_workload("poisson:rate=1,requests=4", overrides={"rate": 8.0}).info["rate"] == 8.0


def test_spread_dequantizes_bursts(trace):
    from pdserve.bench.traces import spread_timestamps

    assert spread_timestamps([0, 0, 0, 3000, 3000, 9000]) == [0, 1000, 2000, 3000, 6000, 9000]
    # the last group spreads over the median gap between stamps (3000 and 6000 -> 4500)
    assert spread_timestamps([0, 3000, 9000, 9000]) == [0, 3000, 9000, 11250]
    reqs = scale_rows(load_trace(trace), TraceScale(spread=True))
    assert [r.arrival_s for r in reqs] == [0.0, 2.0, 4.0, 8.0]  # distinct stamps: unchanged


def test_conversation_rows_keep_a_later_turn_with_the_turn_it_extends(tmp_path):
    # rows 1 and 4 are one conversation's turns (row 4 extends row 1 by two blocks), three rows apart; rows 0, 2
    # and 3 share only the one-block system prompt (id 0) or nothing
    rows = [{"timestamp": 1000 * i, "input_length": 512 * len(h), "output_length": 4, "hash_ids": h}
            for i, h in enumerate([[0, 1], [0, 2, 3], [4, 5], [0, 6], [0, 2, 3, 7, 8], [9]])]
    p = tmp_path / "conv.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    picked = conversation_rows(load_trace(p), 3, 0.3)
    # the turn pair first, then a row that extends nothing once the reuse (3 of 8 blocks) is above the target
    assert [r.hash_ids for r in picked] == [(0, 1), (0, 2, 3), (0, 2, 3, 7, 8)]  # in trace order
    consecutive = build_workload(f"trace:path={p},requests=3,input_scale=0.25")
    turns = build_workload(f"trace:path={p},requests=2,input_scale=0.25,reuse=0.3")
    a, b = (s.turns[0].prompt_ids for s in turns.sessions)
    assert shared_prefix_len(a, b) == 3 * 128 and turns.info["reuse"] == 0.3  # the whole earlier turn is reused
    c = [s.turns[0].prompt_ids for s in consecutive.sessions]
    assert max(shared_prefix_len(x, y) for x, y in ((c[0], c[1]), (c[0], c[2]), (c[1], c[2]))) == 128
    with pytest.raises(TraceError, match="reuse"):
        build_workload(f"trace:path={p},reuse=1.5")
