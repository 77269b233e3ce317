"""`pdserve serve --prefill-ep/--decode-ep/--prefill-dp/--decode-dp`: expert parallelism and data-parallel attention
per worker pool reach vLLM's flags on the workers of that pool, GPU workers get TP x DP GPUs each, and what the
launcher does not plan is refused with what to do."""

from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.launch import plan_workers, worker_command
from pdserve.launch.config import ConfigError


def _cfg(argv):
    return cli.config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def _flags(worker) -> dict[str, str | bool]:
    argv, env = worker_command(worker, "s" * 32)
    out: dict[str, str | bool] = {"gpus": env.get("CUDA_VISIBLE_DEVICES", "")}
    for flag in ("--tensor-parallel-size", "--data-parallel-size"):
        out[flag] = argv[argv.index(flag) + 1] if flag in argv else "1"
    out["ep"] = "--enable-expert-parallel" in argv
    return out


def test_gpu_decode_pool_with_expert_parallelism_over_its_tp_ranks(model_dir):
    cfg = _cfg(["--gpus", "0,1,2,3", "--model", str(model_dir), "--gpus-per-worker", "2", "--decode-ep", "--no-pool"])
    p, d = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))
    assert _flags(p) == {"gpus": "0,1", "--tensor-parallel-size": "2", "--data-parallel-size": "1", "ep": False}
    assert _flags(d) == {"gpus": "2,3", "--tensor-parallel-size": "2", "--data-parallel-size": "1", "ep": True}


def test_wide_ep_decode_pool_on_gpus_gets_tp_x_dp_gpus(model_dir):
    cfg = _cfg(["--gpus", "0,1,2,3,4,5,6,7", "--model", str(model_dir), "--gpus-per-worker", "4", "--prefill-tp", "4",
                "--prefill-ep", "--decode-dp", "4", "--decode-ep", "--no-pool"])
    p, d = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))
    assert _flags(p) == {"gpus": "0,1,2,3", "--tensor-parallel-size": "4", "--data-parallel-size": "1", "ep": True}
    assert _flags(d) == {"gpus": "4,5,6,7", "--tensor-parallel-size": "1", "--data-parallel-size": "4", "ep": True}


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "none", "--decode-dp", "2"], "GPU workers only"),
    (["--gpus", "0,1,2,3", "--decode-dp", "2", "--gpus-per-worker", "2", "--pool"], "add --no-pool"),
    (["--gpus", "0,1,2,3", "--decode-dp", "2", "--gpus-per-worker", "2", "--no-pool", "--policy", "conductor"],
     "--policy least_loaded"),
    (["--gpus", "0,1,2", "--decode-dp", "2", "--gpus-per-worker", "1", "--no-pool"], "TP x DP"),
    (["--gpus", "none", "--colocated", "1", "--decode-ep"], "--worker-args"),
    (["--gpus", "none", "--decode-tp", "2", "--decode-ep", "--no-pool"], "segfaults in its first forward"),
    (["--gpus", "none", "--prefill-tp", "2", "--prefill-ep", "--no-pool"], "drop --prefill-ep/--decode-ep on CPU"),
])
def test_refused_with_what_to_do(model_dir, argv, words):
    with pytest.raises(ConfigError, match=words.replace("-", "\\-")):
        _cfg(["--model", str(model_dir), *argv])
