"""Launcher: --prefill-tp / --decode-tp give vLLM --tensor-parallel-size, one core list per rank, no KV pool."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, config_from_args
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.launch.plan import assign_rank_cores, make_plan


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def _worker(plan, name):
    return next(p for p in plan.processes if p.name == name)


def test_tp_workers_get_a_core_list_per_rank(model):
    cfg = LauncherConfig(model=model, prefill_tp=2, decode_tp=1, cores=(0, 1, 2, 3), cores_per_worker=1)
    assert cfg.pool is False  # the KV pool needs TP=1: off unless asked for
    plan = make_plan(cfg, model)
    p, d = _worker(plan, "prefill0"), _worker(plan, "decode0")
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and d.env["VLLM_CPU_OMP_THREADS_BIND"] == "2"
    i = p.argv.index("--tensor-parallel-size")
    assert p.argv[i + 1] == "2" and "--tensor-parallel-size" not in d.argv
    assert [w.tp for w in plan.workers] == [2, 1]


def test_tp_with_several_cores_per_rank_and_wrapping(model):
    cfg = LauncherConfig(model=model, prefill_tp=2, decode_tp=2, cores=(0, 1, 2, 3), cores_per_worker=2)
    plan = make_plan(cfg, model)
    assert _worker(plan, "prefill0").env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert _worker(plan, "decode0").env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"  # shares the 4 cores
    assert assign_rank_cores([2, 1, 2], (5, 6, 7)) == [(5, 6), (7,), (5, 6)]


@pytest.mark.parametrize("over, needle", [
    ({"prefill_tp": 0}, "prefill_tp=0"),
    ({"decode_tp": True}, "decode_tp=True"),
    ({"prefill_tp": 2, "pool": True}, "add --no-pool"),
    ({"colocated": 1, "prefill_tp": 2}, "--worker-args"),
])
def test_tp_config_errors_are_actionable(model, over, needle):
    with pytest.raises(ConfigError, match=needle):
        LauncherConfig(model=model, **over)


def test_tp_flags(model):
    args = build_parser().parse_args(["serve", "--model", model, "--prefill-tp", "2", "--decode-tp", "1"])
    cfg = config_from_args(args)
    assert (cfg.prefill_tp, cfg.decode_tp, cfg.pool) == (2, 1, False)
    plain = config_from_args(build_parser().parse_args(["serve", "--model", model]))
    assert (plain.prefill_tp, plain.decode_tp) == (1, 1)
