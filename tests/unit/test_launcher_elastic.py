"""`pdserve serve --elastic N`: the launcher's config, plan, worker and router command lines, and the CLI."""

from __future__ import annotations

import json

import pytest

from pdserve import cli
from pdserve.launch import make_plan, plan_workers, router_command, worker_command
from pdserve.launch.config import ConfigError, LauncherConfig


def _cfg(argv):
    return cli.config_from_args(cli.build_parser().parse_args(["serve", "--gpus", "none", *argv]))


def test_config_elastic_has_no_fixed_roles(model_dir):
    c = LauncherConfig(model=str(model_dir), elastic=3)
    assert (c.prefill, c.decode, c.colocated, c.num_workers, c.mode) == (0, 0, 0, 3, "elastic")
    assert c.connector is True and c.pool is True


@pytest.mark.parametrize("kw, msg", [
    ({"prefill": 1}, "give only --elastic N"),
    ({"colocated": 2}, "give only --elastic N"),
    ({"connector": False}, "drop --no-connector"),
    ({"kv_connector": "nixl"}, "elastic roles use pdserve's connector"),
    ({"prefill_tp": 2}, "use --worker-args"),
    ({"decode_args": ("--x",)}, "use --worker-args"),
])
def test_config_elastic_errors_say_how_to_fix(model_dir, kw, msg):
    with pytest.raises(ConfigError, match=msg):
        LauncherConfig(model=str(model_dir), elastic=2, **kw)


def test_plan_elastic_workers_all_kv_both_and_router_gets_one_pool(model_dir):
    cfg = LauncherConfig(model=str(model_dir), elastic=2, policy="conductor", worker_args=("--seed", "1"))
    ws = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))
    assert [(w.name, w.role, w.port, w.cores) for w in ws] == [("elastic0", "elastic", 9001, (0,)),
                                                               ("elastic1", "elastic", 9002, (1,))]
    for w in ws:
        argv, _ = worker_command(w, "s" * 32)
        ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector"] == "PdserveConnector" and ktc["kv_role"] == "kv_both"
        assert argv[-2:] == ["--seed", "1"]
    argv = router_command(cfg, ws, model_dir, 9000)
    i = argv.index("--elastic")
    assert argv[i + 1:i + 3] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert "--prefill" not in argv and "--decode" not in argv and "--colocated" not in argv
    assert argv[argv.index("--policy") + 1] == "conductor"
    plan = make_plan(cfg, model_dir)
    assert [p.name for p in plan.processes if p.name.startswith("elastic")] == ["elastic0", "elastic1"]


def test_cli_elastic_defaults_to_the_conductor(model_dir, tmp_path):
    c = _cfg(["--model", str(model_dir), "--elastic", "2"])
    assert (c.elastic, c.policy, c.mode) == (2, "conductor", "elastic")
    assert _cfg(["--model", str(model_dir), "--elastic", "2", "--policy", "round_robin"]).policy == "round_robin"
    f = tmp_path / "c.yaml"
    f.write_text("prefill: 1\ndecode: 1\npolicy: least_loaded\n")
    c = _cfg(["--config", str(f), "--model", str(model_dir), "--elastic", "2"])
    assert (c.elastic, c.prefill, c.decode, c.policy) == (2, 0, 0, "least_loaded")  # the flag replaces the roles
    f.write_text("elastic: 2\n")
    c = _cfg(["--config", str(f), "--model", str(model_dir), "--prefill", "1", "--decode", "1"])
    assert (c.elastic, c.prefill, c.decode, c.policy) == (0, 1, 1, "round_robin")
    assert _cfg(["--config", str(f), "--model", str(model_dir)]).policy == "conductor"


def test_cli_elastic_takes_an_slo_target_without_naming_the_policy(model_dir):
    """The conductor is the elastic default before the config is checked, so its SLO targets are accepted
    (they used to fail: 'tpot_slo_ms needs policy=conductor')."""
    c = _cfg(["--model", str(model_dir), "--elastic", "2", "--tpot-slo-ms", "80"])
    assert (c.policy, c.tpot_slo_ms) == ("conductor", 80.0)


def test_cli_elastic_dry_run_prints_the_plan(model_dir, capsys):
    rc = cli.main(["serve", "--gpus", "none", "--model", str(model_dir), "--elastic", "2", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("mode: elastic")
    assert "[elastic0]" in out and "[elastic1]" in out and "--elastic http://127.0.0.1:8001 http://127.0.0.1:8002" in out


def test_bench_compare_knows_elastic_n():
    from pdserve.bench.compare import CompareSettings, launcher_config

    s = CompareSettings(model="", cores=(0, 1), max_model_len=2048)
    e = launcher_config("elastic2", s)
    assert (e.elastic, e.cores_per_worker, e.policy, e.connector, e.mode) == (2, 1, "conductor", True, "elastic")
    assert launcher_config("elastic1", s).cores_per_worker == 2
    assert e.router_args == () and launcher_config("elastic2-nomoves", s).router_args == ("--no-moves",)
    with pytest.raises(ConfigError, match="elastic needs at least one worker"):
        launcher_config("elastic0", s)
