"""pdserve/launch/pool_note.py: a launch with pdserve's KV pool says at start-up (and in ``--dry-run``) that the
workers turn the pool off for a hybrid KV cache (sliding window, Mamba / linear attention), and says nothing for
a model the pool serves or a launch without the pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.launch.config import LauncherConfig
from pdserve.launch.pool_note import pool_note, window_layers

GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"],
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
LLAMA = {"architectures": ["LlamaForCausalLM"]}


def _model(tmp_path: Path, cfg: dict) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_window_layers_are_found():
    assert window_layers(GEMMA3) == "3 of 4 layers in layer_types slide"
    assert window_layers({"hybrid_layer_pattern": [0, 1, 1, 1]}) == "3 sliding-window layers in hybrid_layer_pattern"
    assert window_layers({"text_config": GEMMA3}) and not window_layers(LLAMA) and not window_layers(QWEN3_NEXT)


@pytest.mark.parametrize("cfg, groups", [(GEMMA3, "layers in layer_types slide"),
                                         (QWEN3_NEXT, "['linear_attention']")])
def test_a_hybrid_model_with_the_pool_gets_the_note(tmp_path, cfg, groups):
    note = pool_note(LauncherConfig(model=str(_model(tmp_path, cfg))), tmp_path / "model")
    assert note.startswith("kv pool: off on every worker") and groups in note and "--no-pool" in note


@pytest.mark.parametrize("cfg, settings", [(LLAMA, {}), (GEMMA3, {"pool": False}),
                                           (GEMMA3, {"kv_connector": "mooncake", "pool_backend": "mooncake"}),
                                           (QWEN3_NEXT, {"kv_connector": "nixl"})])
def test_no_note_where_the_pool_is_not_pdserves_or_the_model_is_not_hybrid(tmp_path, cfg, settings):
    assert pool_note(LauncherConfig(model=str(_model(tmp_path, cfg)), **settings), tmp_path / "model") == ""


def test_dry_run_prints_the_note(tmp_path, capsys):
    model = _model(tmp_path, GEMMA3)
    assert cli.main(["serve", "--model", str(model), "--port", "0", "--dry-run"]) == 0
    assert "kv pool: off on every worker for this model" in capsys.readouterr().out
    assert cli.main(["serve", "--model", str(model), "--port", "0", "--dry-run", "--no-pool"]) == 0
    assert "kv pool:" not in capsys.readouterr().out
