"""The workers' per-step token budget reaches the elastic conductor's chunk model: the launcher passes it to the
router (--max-num-batched-tokens), the router validates it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.launch import plan_workers, router_command
from pdserve.launch.commands import step_tokens
from pdserve.launch.config import LauncherConfig
from pdserve.router.__main__ import config_from_args
from pdserve.router.config import RouterConfigError


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                               "max_position_embeddings": 2048}))
    (d / "tokenizer.json").write_text("{}")
    return d


def _router_step(cfg: LauncherConfig, model_dir: Path) -> str | None:
    ws = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))
    argv = router_command(cfg, ws, model_dir, 9000)
    return argv[argv.index("--max-num-batched-tokens") + 1] if "--max-num-batched-tokens" in argv else None


def test_elastic_router_gets_the_workers_step_budget(model_dir):
    cfg = LauncherConfig(model=str(model_dir), elastic=2, policy="conductor", max_num_batched_tokens=512)
    assert _router_step(cfg, model_dir) == "512"


def test_elastic_router_gets_vllms_cpu_default_when_none_is_given(model_dir):
    assert _router_step(LauncherConfig(model=str(model_dir), elastic=2, policy="conductor"), model_dir) == "2048"


def test_fixed_role_router_is_not_given_it(model_dir):
    cfg = LauncherConfig(model=str(model_dir), prefill=1, decode=1, max_num_batched_tokens=512)
    assert _router_step(cfg, model_dir) is None


def test_step_tokens_unknown_when_a_worker_sets_it_itself_or_runs_on_a_gpu(model_dir):
    ws = plan_workers(LauncherConfig(model=str(model_dir), elastic=2), model_dir, ports=[9001, 9002], cores=(0, 1))
    assert step_tokens(ws) == 2048
    assert step_tokens([ws[0], replace(ws[1], extra_args=("--max-num-batched-tokens=256",))]) is None
    assert step_tokens([replace(w, gpus=("0",)) for w in ws]) is None
    assert step_tokens([replace(ws[0], max_num_batched_tokens=256), ws[1]]) is None  # they differ
    assert step_tokens([replace(w, gpus=("0",), max_num_batched_tokens=256) for w in ws]) == 256


def test_router_flag_and_validation(model_dir):
    base = ["--model-dir", str(model_dir), "--elastic", "http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert config_from_args(base).max_num_batched_tokens is None
    assert config_from_args([*base, "--max-num-batched-tokens", "512"]).max_num_batched_tokens == 512
    with pytest.raises(RouterConfigError, match="--max-num-batched-tokens 0: the workers' vLLM"):
        config_from_args([*base, "--max-num-batched-tokens", "0"])
