"""pdserve/launch/plane_limits.py: a P -> D launch on vLLM's NixlConnector or MooncakeConnector is refused for a
model with Mamba / linear-attention layers in half precision (vLLM hands it off one token short), at
``pdserve serve`` start-up (``make_plan``) and in ``--dry-run``; everything else is planned as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.launch import make_plan
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.launch.plane_limits import state_layers

QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"],
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
GRANITE_HYBRID = {"architectures": ["GraniteMoeHybridForCausalLM"], "mamba_n_heads": 4,
                  "layer_types": ["mamba", "mamba", "attention", "mamba"]}
NEMOTRON_H = {"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-M*-"}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}


def _model(tmp_path: Path, cfg: dict) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _plan(tmp_path: Path, cfg: dict, **settings):
    model = _model(tmp_path, cfg)
    config = LauncherConfig(model=str(model), port=0, **{"cores": (0, 1), **settings})
    return make_plan(config, model)


def test_state_layers_are_found_in_each_way_a_config_names_them():
    assert "3 of 4 layers" in state_layers(QWEN3_NEXT)
    assert "3 of 4 layers" in state_layers(GRANITE_HYBRID)
    assert state_layers(NEMOTRON_H) == "2 Mamba layers in hybrid_override_pattern"
    assert state_layers({"text_config": QWEN3_NEXT}) != ""
    assert state_layers({"architectures": ["Mamba2ForCausalLM"]}) == "architecture Mamba2ForCausalLM"
    assert state_layers(GEMMA3) == "" and state_layers({"architectures": ["LlamaForCausalLM"]}) == ""


@pytest.mark.parametrize("plane, where", [("nixl", "nixl/base_scheduler.py:379"),
                                          ("mooncake", "mooncake/mooncake_connector.py:946")])
def test_a_state_model_in_half_precision_is_refused_on_vllms_planes(tmp_path, plane, where):
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, QWEN3_NEXT, kv_connector=plane, dtype="bfloat16")
    msg = str(e.value)
    assert f"--kv-connector {plane}" in msg and "one token short" in msg and where in msg
    assert "--kv-connector pdserve" in msg and "--dtype float32" in msg  # what to use instead


def test_gpu_workers_without_a_dtype_count_as_half_precision(tmp_path):
    """vLLM's auto dtype downcasts even a float32 checkpoint on GPUs."""
    with pytest.raises(ConfigError, match="vLLM's auto dtype"):
        _plan(tmp_path, dict(GRANITE_HYBRID, torch_dtype="float32"), kv_connector="nixl", gpus=("0", "1"),
              pool=False)
    assert _plan(tmp_path, GRANITE_HYBRID, kv_connector="nixl", gpus=("0", "1"), pool=False, dtype="float32")


@pytest.mark.parametrize("cfg, settings", [
    (GRANITE_HYBRID, {"kv_connector": "nixl", "dtype": "float32"}),  # fp32: the split answered exactly
    (QWEN3_NEXT, {"kv_connector": "pdserve", "dtype": "bfloat16"}),  # pdserve's connector hands off h(N)
    (GEMMA3, {"kv_connector": "mooncake", "dtype": "bfloat16"}),  # no state layers: no one-token-short hand-off
    (QWEN3_NEXT, {"kv_connector": "nixl", "dtype": "bfloat16", "prefill": 0, "decode": 0, "colocated": 1}),
])
def test_everything_else_is_planned(tmp_path, cfg, settings):
    assert make_plan(LauncherConfig(model=str(_model(tmp_path, cfg)), port=0, cores=(0, 1), **settings),
                     tmp_path / "model").workers


def test_dry_run_refuses_with_the_message_and_exit_code_2(tmp_path, capsys):
    model = _model(tmp_path, QWEN3_NEXT)
    rc = cli.main(["serve", "--model", str(model), "--port", "0", "--dry-run", "--kv-connector", "mooncake",
                   "--dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert rc == 2 and "config error: --kv-connector mooncake" in err and "Traceback" not in err
    assert cli.main(["serve", "--model", str(model), "--port", "0", "--dry-run", "--dtype", "bfloat16"]) == 0


def test_a_dtype_in_the_worker_args_is_the_one_judged(tmp_path):
    """vLLM takes the last ``--dtype``: ``--worker-args`` come after the launcher's own."""
    with pytest.raises(ConfigError, match="in bfloat16"):
        _plan(tmp_path, GRANITE_HYBRID, kv_connector="nixl", dtype="float32", worker_args=("--dtype", "bfloat16"))
    with pytest.raises(ConfigError, match="in auto"):
        _plan(tmp_path, GRANITE_HYBRID, kv_connector="nixl", dtype="float32", decode_args=("--dtype=auto",))
    assert _plan(tmp_path, GRANITE_HYBRID, kv_connector="nixl", dtype="bfloat16", worker_args=("--dtype", "float32"))


DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512, "qk_rope_head_dim": 64}
NATIVE = "-cc.custom_ops+=-rotary_embedding"


@pytest.mark.parametrize("plane", ["nixl", "mooncake"])
def test_mla_on_cpu_is_refused_on_vllms_planes_unless_every_worker_runs_pytorch_rotary(tmp_path, plane):
    """vLLM's connectors have D compute the last prompt token on P's KV, which vLLM's CPU rotary kernel caches
    otherwise than one worker's single pass (0 of 4 equal in the coverage matrix; 4 of 4 with PyTorch rotary)."""
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, DEEPSEEK_V3, kv_connector=plane, dtype="float32")
    msg = str(e.value)
    assert "MLA model on CPU workers" in msg and "last prompt token" in msg and f"--worker-args '{NATIVE}'" in msg
    assert _plan(tmp_path, DEEPSEEK_V3, kv_connector=plane, dtype="float32", worker_args=(NATIVE,)).workers
    assert _plan(tmp_path, DEEPSEEK_V3, kv_connector=plane, dtype="float32",  # the same in -cc's JSON
                 worker_args=("-cc", '{"custom_ops": ["-rotary_embedding"]}')).workers
    with pytest.raises(ConfigError):  # one worker without it is enough to answer wrong
        _plan(tmp_path, DEEPSEEK_V3, kv_connector=plane, dtype="float32", prefill_args=(NATIVE,))
    assert _plan(tmp_path, DEEPSEEK_V3, kv_connector=plane, dtype="float32", gpus=("0", "1"), pool=False).workers


def test_mla_on_cpu_with_other_tp_on_p_and_d_is_refused_on_pdserves_connector_too(tmp_path):
    with pytest.raises(ConfigError, match=r"other tensor-parallel degrees \(\[1, 2\]\)"):
        _plan(tmp_path, DEEPSEEK_V3, dtype="float32", prefill_tp=2, decode_tp=1, cores=(0, 1, 2), pool=False)
    assert _plan(tmp_path, DEEPSEEK_V3, dtype="float32", prefill_tp=2, decode_tp=1, cores=(0, 1, 2), pool=False,
                 worker_args=(NATIVE,)).workers
    assert _plan(tmp_path, DEEPSEEK_V3, dtype="float32").workers  # same TP, pdserve's connector: exact as is
    assert make_plan(LauncherConfig(model=str(_model(tmp_path, DEEPSEEK_V3)), port=0, cores=(0, 1), dtype="float32",
                                    kv_connector="nixl", prefill=0, decode=0, colocated=1), tmp_path / "model").workers
