"""pdserve/launch/pool_note.py: pdserve's KV pool takes hybrid KV caches (no note); a launch whose workers turn
prefix caching off says at start-up (and in ``--dry-run``) that they will not use the pool; Mooncake Store as the
pool is refused for a Mamba / linear-attention model whose workers run with prefix caching off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.launch.pool_note import check_pool_model, pool_note, window_layers

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


def test_a_hybrid_model_with_the_pool_gets_no_note_the_pool_takes_it(tmp_path):
    for cfg in (GEMMA3, QWEN3_NEXT):
        assert pool_note(LauncherConfig(model=str(_model(tmp_path, cfg))), tmp_path / "model") == ""


@pytest.mark.parametrize("cfg, groups", [(GEMMA3, "layers in layer_types slide"),
                                         (QWEN3_NEXT, "['linear_attention']")])
def test_workers_without_prefix_caching_get_the_note(tmp_path, cfg, groups):
    config = LauncherConfig(model=str(_model(tmp_path, cfg)), worker_args=("--no-enable-prefix-caching",))
    note = pool_note(config, tmp_path / "model")
    assert note.startswith("kv pool: not used by the prefill and decode workers") and groups in note
    assert "--no-pool" in note
    only_d = LauncherConfig(model=str(_model(tmp_path, cfg)), decode_args=("--no-enable-prefix-caching",))
    assert pool_note(only_d, tmp_path / "model").startswith("kv pool: not used by the decode workers")
    back_on = ("--no-enable-prefix-caching", "--enable-prefix-caching")
    assert pool_note(LauncherConfig(model=str(_model(tmp_path, cfg)), worker_args=back_on), tmp_path / "model") == ""


@pytest.mark.parametrize("cfg, settings", [(LLAMA, {}), (GEMMA3, {"pool": False}),
                                           (GEMMA3, {"kv_connector": "mooncake", "pool_backend": "mooncake"}),
                                           (QWEN3_NEXT, {"kv_connector": "nixl"})])
def test_no_note_where_the_pool_is_not_pdserves_or_the_model_is_not_hybrid(tmp_path, cfg, settings):
    settings = {**settings, "worker_args": ("--no-enable-prefix-caching",)}
    assert pool_note(LauncherConfig(model=str(_model(tmp_path, cfg)), **settings), tmp_path / "model") == ""


GRANITE = {"architectures": ["GraniteMoeHybridForCausalLM"], "layer_types": ["mamba", "mamba", "attention", "mamba"]}


def test_mooncake_store_is_refused_for_a_state_model_without_prefix_caching(tmp_path):
    model = _model(tmp_path, GRANITE)
    args = ["serve", "--model", str(model), "--port", "0", "--dry-run", "--kv-connector", "mooncake",
            "--pool-backend", "mooncake", "--dtype", "float32"]
    assert cli.main([*args, "--worker-args=--no-enable-prefix-caching"]) != 0
    assert cli.main(args) == 0  # with prefix caching on, vLLM's align mode: MooncakeStoreConnector takes it
    with pytest.raises(ConfigError, match="mamba_cache_mode 'align'"):
        check_pool_model(LauncherConfig(model=str(model), kv_connector="mooncake", pool_backend="mooncake",
                                        worker_args=("--no-enable-prefix-caching",)), model)
    check_pool_model(LauncherConfig(model=str(_model(tmp_path, GEMMA3)), kv_connector="mooncake",
                                    pool_backend="mooncake", worker_args=("--no-enable-prefix-caching",)), model)


def test_dry_run_prints_the_note(tmp_path, capsys):
    model = _model(tmp_path, GEMMA3)
    args = ["serve", "--model", str(model), "--port", "0", "--dry-run", "--worker-args=--no-enable-prefix-caching"]
    assert cli.main(args) == 0
    assert "kv pool: not used by the prefill and decode workers" in capsys.readouterr().out
    assert cli.main([*args, "--no-pool"]) == 0
    assert "kv pool:" not in capsys.readouterr().out
    assert cli.main(["serve", "--model", str(model), "--port", "0", "--dry-run"]) == 0
    assert "kv pool:" not in capsys.readouterr().out
