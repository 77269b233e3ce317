"""The corruption tally's count (benchmarks/corruption_tally.py over tests/integration/corruption_tally.py's rows):
an injection with no outcome is stalled, counted as injected and not detected."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_a_stalled_case_counts_as_injected_and_undetected(tmp_path, monkeypatch, capsys):
    rows_mod = _load("tests/integration/corruption_tally.py", "tally_rows")
    bench = _load("benchmarks/corruption_tally.py", "tally_bench")
    out = tmp_path / "tally.jsonl"
    monkeypatch.setenv("PDSERVE_CORRUPTION_TALLY", str(out))
    rows_mod.injected("p2p", "caught", layers=["l0"]).done(True, True)
    rows_mod.injected("p2p", "missed", layers=["l1"]).done(False)
    rows_mod.injected("p2p", "stalled", layers=["l1"])  # the case never returned
    rows_mod.record("pool", "old style", True, False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    bench.summarize(rows, 0)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["p2p_injected"] == 3 and result["p2p_detected"] == 1
    assert result["p2p_undetected"] == 1 and result["p2p_stalled"] == 1 and result["p2p_wrong_answers"] == 0
    assert result["pool_wrong_answers"] == 1 and result["detected_share"] == 0.5
    monkeypatch.delenv("PDSERVE_CORRUPTION_TALLY")
    rows_mod.injected("p2p", "nowhere").done(True)  # without the variable nothing is written
    assert len(out.read_text().splitlines()) == len(rows)
