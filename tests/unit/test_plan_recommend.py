"""The recommendation flips from colocated to PD as prompts and rate grow; the CLI prints and plots it."""

import json

import pytest

from pdserve.plan.cli import main
from pdserve.plan.cost import HardwareCostModel, Parallelism
from pdserve.plan.hardware import accelerator, link
from pdserve.plan.kvsize import load_model
from pdserve.plan.results import Targets
from pdserve.plan.search import candidates, evaluate, rank, reason
from pdserve.plan.simulator import SimSettings
from pdserve.plan.traffic import LengthMix, poisson


def _recommend(prompt: int, rate: float) -> tuple[str, str]:
    cost = HardwareCostModel(load_model("llama-3-8b"), accelerator("H100"), link("efa-p5"), Parallelism(1))
    settings = SimSettings(Targets(3.0, 0.03), policy="round_robin", kv_capacity_tokens=cost.kv_capacity_tokens())
    reqs = poisson(rate, 300, LengthMix.parse(f"{prompt}:200", jitter=0.2), seed=5)
    ranked = rank(evaluate(candidates(4, 1), cost, settings, reqs))
    return ranked[0]["config"], reason(ranked, reqs)


def test_short_prompts_low_rate_stay_colocated():
    best, why = _recommend(prompt=300, rate=2)
    assert best.startswith("colocated"), why


def test_long_prompts_high_rate_disaggregate():
    best, why = _recommend(prompt=16000, rate=3)
    assert not best.startswith("colocated"), why
    assert "TPOT p99" in why


def test_cli_json_and_text(capsys):
    args = ["--model", "llama-3-8b", "--hardware", "H100", "--network", "efa-p5", "--gpus", "2",
            "--rate", "2", "--lengths", "0.5:4000:50,0.5:200:50", "--requests", "100", "--ttft", "2", "--tpot", "0.05"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] in {"colocated x2", "1P1D", "elastic x2"}
    assert {c["config"] for c in out["candidates"]} == {"colocated x2", "1P1D", "elastic x2"}
    assert out["kv"]["kv_bytes_per_token"] == 131072
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "recommended:" in text and "TPOT p99" in text


def test_cli_kv_only_and_errors(capsys):
    assert main(["--model", "llama-3-70b", "--kv-only", "--context", "131072", "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    assert kv["kv_bytes_request"] == 40 * 1024 ** 3
    assert main(["--model", "nope-7b", "--kv-only"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["--model", "llama-3-8b"]) == 2  # no traffic given
    assert "--trace" in capsys.readouterr().err


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install matplotlib)")
    png = tmp_path / "goodput.png"
    assert main(["--model", "llama-3-8b", "--hardware", "H100", "--network", "efa-p5", "--gpus", "2", "--rate", "2",
                 "--lengths", "2000:50", "--requests", "60", "--plot", str(png), "--rates", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.stat().st_size > 1000 and set(out["sweep"]) == {"colocated x2", "1P1D", "elastic x2"}
