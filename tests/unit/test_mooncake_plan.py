"""`pdserve serve --kv-connector mooncake`: the launch plan (pdserve/launch/plan.py, pdserve/launch/mooncake.py) --
each worker's --kv-transfer-config and MooncakeConnector variables, the router's flags, and what is refused."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import build_parser, config_from_args
from pdserve.launch.commands import worker_argv, worker_env
from pdserve.launch.config import ConfigError, LauncherConfig, WorkerConfig
from pdserve.launch.plan import dry_run_ports, make_plan


def _cfg(tmp_path, **kw) -> LauncherConfig:
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return LauncherConfig(model=str(model), cores=(0, 1), **kw)


def _kv(argv) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_cpu_plan_workers_router_and_ports(tmp_path):
    cfg = _cfg(tmp_path, kv_connector="mooncake", lease_s=12.5, prefill=2, decode=1,
               connector_extra={"num_workers": 4})
    assert cfg.pool is False  # pdserve's KV pool works through pdserve's connector only
    ports = dry_run_ports(cfg)
    assert ports.side_channels == tuple(ports.workers[-1] + i for i in (1, 2, 3))
    plan = make_plan(cfg, cfg.model_dir)
    assert plan.pool is None and not plan.of_kind("pool")
    for w, p, side in zip(plan.workers, plan.of_kind("worker"), ports.side_channels):
        assert _kv(p.argv) == {
            "kv_connector": "MooncakeConnector", "kv_connector_module_path": "pdserve.vllm.mooncake_cpu",
            "kv_role": "kv_both", "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 4}}
        assert p.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == str(side) == str(w.mooncake_bootstrap_port)
        assert p.env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] == "13"  # P's hold on unpulled blocks: lease_s
        assert p.env["VLLM_HOST_IP"] == "127.0.0.1" and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in p.env
        assert w.nixl_side_channel_port == 0
        assert not p.secret  # MooncakeConnector has no use for pdserve's transfer secret
    r = plan.router.argv
    assert r[r.index("--kv-connector") + 1] == "mooncake"
    assert r[r.index("--mooncake-bootstrap") + 1] == ",".join(
        f"{w.url}={w.mooncake_bootstrap_port}" for w in plan.workers)
    assert "--mooncake-bootstrap" not in make_plan(_cfg(tmp_path), cfg.model_dir).router.argv


def test_protocol_and_gpu_workers(tmp_path):
    cfg = _cfg(tmp_path, kv_connector="mooncake", mooncake_protocol="rdma", gpus=("0", "1"),
               connector_extra={"device_name": "mlx5_0"})
    for p in make_plan(cfg, cfg.model_dir).of_kind("worker"):
        kv = _kv(p.argv)  # a GPU worker loads vLLM's class as it is: no torch patch
        assert "kv_connector_module_path" not in kv and kv["kv_buffer_device"] == "cuda"
        assert kv["kv_connector_extra_config"] == {"mooncake_protocol": "rdma", "device_name": "mlx5_0"}
        assert p.env["CUDA_VISIBLE_DEVICES"] in ("0", "1")


def test_host_from_env_wins_and_wildcard_is_not_advertised(tmp_path):
    w = WorkerConfig(role="prefill", index=0, model="/m", port=8100, cores=(0,), kv_connector="mooncake",
                     mooncake_bootstrap_port=8998, env={"VLLM_HOST_IP": "10.1.2.3"})
    assert worker_env(w)["VLLM_HOST_IP"] == "10.1.2.3"
    assert "MooncakeConnector" in " ".join(worker_argv(w))
    anywhere = WorkerConfig(role="prefill", index=0, model="/m", port=8100, host="0.0.0.0", cores=(0,),
                            kv_connector="mooncake", mooncake_bootstrap_port=8998)
    assert "VLLM_HOST_IP" not in worker_env(anywhere)  # vLLM then finds this host's address itself


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="pool=true with kv_connector='mooncake'.*--kv-connector mooncake"):
        _cfg(tmp_path, kv_connector="mooncake", pool=True)
    with pytest.raises(ConfigError, match="kv_connector='mooncake' with elastic workers"):
        _cfg(tmp_path, kv_connector="mooncake", elastic=2)
    with pytest.raises(ConfigError, match="mooncake_bootstrap_port=0"):
        WorkerConfig(role="decode", index=0, model="/m", cores=(0,), kv_connector="mooncake")
    with pytest.raises(ConfigError, match="mooncake_protocol"):
        _cfg(tmp_path, kv_connector="mooncake", mooncake_protocol="carrier-pigeon")


def test_cli_flags(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = build_parser().parse_args(["serve", "--model", str(model), "--kv-connector", "mooncake",
                                      "--mooncake-protocol", "rdma", "--gpus", "none"])
    cfg = config_from_args(args, discover=lambda: ())
    assert (cfg.kv_connector, cfg.mooncake_protocol, cfg.pool) == ("mooncake", "rdma", False)


# ---------------------------------------------------------------- --pool-backend mooncake (Mooncake Store)

@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
def test_mooncake_store_pool_plan(tmp_path, connector):
    cfg = _cfg(tmp_path, kv_connector=connector, pool_backend="mooncake", pool_mem="256MiB", policy="conductor")
    assert cfg.pool is True  # the backend turns the pool on
    plan = make_plan(cfg, cfg.model_dir, run_dir=tmp_path / "run")
    assert plan.pool is not None and plan.pool.backend == "mooncake"
    assert [p.name for p in plan.of_kind("pool")] == ["mooncake-master"]  # no pdserve store node
    master = plan.process("mooncake-master")
    assert master.argv[0].endswith("mooncake_master") and not master.secret
    assert master.argv[master.argv.index("--rpc_port") + 1] == str(plan.pool.port) == str(master.listen_port)
    store = json.loads(plan.pool.store_config_text)
    assert store["master_server_address"] == f"127.0.0.1:{plan.pool.port}"
    assert store["global_segment_size"] == 256 << 20 and store["metadata_server"] == "P2PHANDSHAKE"
    assert plan.pool.store_config == str(tmp_path / "run" / "mooncake-store.json")
    lookups = set()
    for p, w in zip(plan.of_kind("worker"), plan.workers):
        kv = _kv(p.argv)
        assert kv["kv_connector"] == "MultiConnector"
        first, second = kv["kv_connector_extra_config"]["connectors"]
        assert first["kv_connector"] == {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}[connector]
        # each worker's store lookup socket its own (the IPC path names lookup_rpc_port, not the worker)
        assert second == {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"lookup_rpc_port": w.port}}
        lookups.add(w.port)
        assert p.env["MOONCAKE_CONFIG_PATH"] == plan.pool.store_config
        if connector == "mooncake":  # the class whose Prometheus counters MultiConnector needs
            assert first["kv_connector_module_path"] == "pdserve.vllm.mooncake_cpu"
        assert "pool_master" not in json.dumps(kv)  # pdserve's pool is not involved
    assert len(lookups) == len(plan.workers)
    assert "--pool-master" not in plan.router.argv  # pdserve's pool master: none here
    # the conductor follows the store through its master's HTTP admin server (its metrics port)
    argv = plan.router.argv
    assert argv[argv.index("--mooncake-store") + 1] == f"127.0.0.1:{plan.pool.metrics_port}"
    master_argv = plan.process("mooncake-master").argv
    assert master_argv[master_argv.index("--metrics_port") + 1] == str(plan.pool.metrics_port)
    rr_cfg = _cfg(tmp_path, kv_connector=connector, pool_backend="mooncake", policy="round_robin")
    rr = make_plan(rr_cfg, rr_cfg.model_dir, run_dir=tmp_path / "run")
    assert "--mooncake-store" not in rr.router.argv  # no conductor, nothing to count for


def test_mooncake_store_pool_refusals(tmp_path):
    with pytest.raises(ConfigError, match="pool_backend=mooncake with kv_connector='pdserve'"):
        _cfg(tmp_path, pool_backend="mooncake")
    with pytest.raises(ConfigError, match="--pool-backend mooncake"):
        _cfg(tmp_path, kv_connector="nixl", pool=True)
    off = _cfg(tmp_path, kv_connector="nixl", pool_backend="mooncake", pool=False)
    plan = make_plan(off, off.model_dir)
    assert plan.pool is None and "MultiConnector" not in " ".join(plan.process("prefill0").argv)



def test_single_rank_cpu_workers_run_the_model_in_the_engine_core(monkeypatch):
    """A CPU worker of one rank gets vLLM's uni executor (a busy-polling executor process on a shared core starved
    a co-located P's MooncakeConnector threads); TP and GPU workers keep vLLM's default; a value set in the worker's or the launcher's env wins."""
    from pdserve.launch.commands import UNI_EXECUTOR_ENV

    monkeypatch.delenv(UNI_EXECUTOR_ENV, raising=False)

    def env(**kw):
        return worker_env(WorkerConfig(role="prefill", index=0, model="/m", port=8100, kv_connector="mooncake",
                                       mooncake_bootstrap_port=8998, **kw))

    assert env(cores=(0,))[UNI_EXECUTOR_ENV] == "0"
    assert UNI_EXECUTOR_ENV not in env(cores=(0, 1), tp=2)
    assert UNI_EXECUTOR_ENV not in env(cores=(0,), gpus=("0",))
    assert env(cores=(0,), env={UNI_EXECUTOR_ENV: "1"})[UNI_EXECUTOR_ENV] == "1"
    monkeypatch.setenv(UNI_EXECUTOR_ENV, "1")  # set in the launcher's own environment: the workers inherit it
    assert UNI_EXECUTOR_ENV not in env(cores=(0,))


def test_uni_executor_workers_pin_their_openmp_threads_to_their_cores(monkeypatch):
    """vLLM pins OpenMP threads only in its multiprocess executor: a uni-executor CPU worker gets OMP_NUM_THREADS,
    OMP_PLACES and OMP_PROC_BIND for its own cores from the launcher (else torch runs one unpinned thread per core
    of the machine in every worker); TP (vLLM's executor pins), GPU and multiprocess workers get none; values set in
    the worker's or the launcher's env win."""
    from pdserve.launch.commands import OMP_PIN_VARS, UNI_EXECUTOR_ENV

    for var in (UNI_EXECUTOR_ENV, *OMP_PIN_VARS):
        monkeypatch.delenv(var, raising=False)

    def env(**kw):
        return worker_env(WorkerConfig(role="decode", index=0, model="/m", port=8100, **kw))

    one = env(cores=(1,))
    assert (one["OMP_NUM_THREADS"], one["OMP_PLACES"], one["OMP_PROC_BIND"]) == ("1", "{1}", "true")
    assert env(cores=(3, 2))["OMP_PLACES"] == "{2,3}" and env(cores=(3, 2))["OMP_NUM_THREADS"] == "2"
    for other in (env(cores=(0, 1), tp=2), env(cores=(0,), gpus=("0",)), env(cores=(0,), env={UNI_EXECUTOR_ENV: "1"}),
                  env(cores=(0,), env={"OMP_NUM_THREADS": "4"})):
        assert "OMP_PLACES" not in other
    monkeypatch.setenv("OMP_PROC_BIND", "false")  # the launcher's own: the workers inherit it, and nothing is added
    assert "OMP_PLACES" not in env(cores=(0,))


@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
def test_kv_checksum_on_vllms_planes_is_said_not_dropped(tmp_path, connector, capsys):
    """Issue 41: vLLM's data planes move KV unverified; the launch says so (start-up log and --dry-run) instead of
    dropping --kv-checksum without a word; pdserve's own plane and pool say what they verify."""
    from pdserve import cli
    from pdserve.launch.checksum_note import checksum_note

    note = checksum_note(_cfg(tmp_path, kv_connector=connector))
    assert note.startswith("kv checksum: NOT applied: vLLM's") and "Mooncake Store" not in note
    store = checksum_note(_cfg(tmp_path, kv_connector=connector, pool_backend="mooncake"))
    assert "and Mooncake Store move KV blocks unverified" in store
    assert checksum_note(_cfg(tmp_path, kv_connector=connector, kv_checksum=False)).startswith("kv checksum: off")
    own = checksum_note(_cfg(tmp_path))
    assert own.startswith("kv checksum: on: every P -> D read (any TP degrees) and every KV pool object")
    assert "pool" not in checksum_note(_cfg(tmp_path, pool=False))
    assert checksum_note(_cfg(tmp_path, connector_extra={"kv_checksum": False})).startswith("kv checksum: off")
    model = tmp_path / "m"
    assert cli.main(["serve", "--gpus", "none", "--model", str(model), "--port", "0", "--kv-connector", connector,
                     "--dry-run"]) == 0
    assert "kv checksum: NOT applied" in capsys.readouterr().out
