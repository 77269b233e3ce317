"""`pdserve plan --profile DIR` (pdserve/plan/profile.py): the planner calibrated from a `pdserve bench compare` run's
own requests, simulating the same requests, and reporting its error against what was measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.plan.cli import main
from pdserve.plan.profile import calibrate_run, load_runs, shape, table, validate
from pdserve.settings.errors import ConfigError

PREFILL = (0.02, 2e-4)  # a + b * prompt tokens
STEP = 0.03  # one decode step, batch 1


def record(start: float, prompt: int, output: int) -> dict:
    ttft = PREFILL[0] + PREFILL[1] * prompt
    itl = [STEP] * (output - 1)
    e2e = ttft + sum(itl)
    return {"ok": True, "session": 0, "turn": 0, "scheduled_s": start, "start_s": start, "ttft_s": ttft,
            "tpot_s": sum(itl) / (output - 1), "e2e_s": e2e, "handoff_gap_s": STEP, "end_s": start + e2e,
            "prompt_tokens": prompt, "output_tokens": output, "itl_s": itl, "error": None, "timings": None}


def bench_out(tmp: Path) -> Path:
    """A `pdserve bench compare --out` folder: one colocated worker, requests one after another (none overlap)."""
    records, t = [], 0.0
    for i in range(12):
        r = record(t, (64, 256, 1024)[i % 3], 8)
        records.append(r)
        t += r["e2e_s"] + 0.5
    (tmp / "raw").mkdir()
    (tmp / "raw" / "colocated1__poisson.json").write_text(json.dumps({"records": records}))
    (tmp / "results.json").write_text(json.dumps({"order": ["colocated1"], "settings": {"kv_cache_gib": 1},
                                                  "configs": {"colocated1": {"workloads": {"poisson": {}}}}}))
    return tmp


def test_a_run_calibrates_the_planner_that_then_predicts_it(tmp_path):
    folder = bench_out(tmp_path)
    runs, settings = load_runs(folder)
    assert [(r.config, r.workload, len(r.records)) for r in runs] == [("colocated1", "poisson", 12)]
    cal = calibrate_run(runs[0], 1000, 1e9)
    assert cal.prefill_coef[0] == pytest.approx(PREFILL[0], rel=0.05)
    assert cal.prefill_coef[1] == pytest.approx(PREFILL[1], rel=0.05)
    rows = validate(folder, 1000, 1e9)
    assert len(rows) == 1
    err = rows[0]["error"]
    assert abs(err["ttft_p50"]) < 0.05 and abs(err["tpot_p50"]) < 0.1  # the planner reproduces the run it learnt
    assert rows[0]["measured"]["output_tok_per_s"] > 0 and err["output_tok_per_s"] is not None
    text = "\n".join(table(rows))
    assert "colocated1" in text and "error" in text and "%" in text


def test_shapes_and_bad_input(tmp_path):
    assert (shape("colocated2")[0].colocated, shape("1p1d")[0].prefill, shape("1p2d-conductor")[1]) == (2, 1,
                                                                                                     "conductor")
    assert shape("elastic2")[0].elastic == 2 and shape("elastic2")[1] == "conductor"
    with pytest.raises(ConfigError, match="colocatedN"):
        shape("vllm-router")
    with pytest.raises(ConfigError, match="results.json"):
        load_runs(tmp_path)


def test_the_command_prints_the_error_table(tmp_path, capsys):
    folder = bench_out(tmp_path)
    assert main(["--model", "smollm2-135m", "--hardware", "H200", "--network", "efa-p5en", "--profile",
                 str(folder)]) == 0
    out = capsys.readouterr().out
    assert "the planner against the measured runs" in out and "colocated1" in out


def test_one_queue_times_each_prompt_from_the_head_of_the_queue():
    from pdserve.plan.profile import prefill_samples

    def r(start: float, ttft: float, prompt: int) -> dict:
        return {"start_s": start, "ttft_s": ttft, "prompt_tokens": prompt}

    recs = [r(0.0, 1.0, 100), r(0.5, 2.5, 200), r(5.0, 0.4, 300)]  # the second waited 0.5 s behind the first
    assert prefill_samples(recs, one_queue=True) == [(100, 1.0), (200, 2.0), (300, pytest.approx(0.4))]
    assert prefill_samples(recs, one_queue=False) == [(100, 1.0), (300, 0.4)]  # only those that found it empty


def test_decode_gaps_that_span_another_prompts_computing_are_left_out():
    from pdserve.plan.profile import clear_gaps, prefill_windows

    decoding = {"start_s": 0.0, "ttft_s": 1.0, "itl_s": [0.1, 0.1, 0.5, 0.1, 0.1], "prompt_tokens": 10}
    other = {"start_s": 1.25, "ttft_s": 0.45, "prompt_tokens": 500}  # computes its prompt from 1.25 to 1.7
    windows = prefill_windows([decoding, other])
    assert windows == [(0.0, 1.0), (1.25, 1.7)]
    # decoding's tokens at 1.1, 1.2, 1.7, 1.8, 1.9: the 0.5 s gap (1.2 -> 1.7) is a step plus the other's prefill
    assert clear_gaps(decoding, windows) == pytest.approx([0.1, 0.1, 0.1])
