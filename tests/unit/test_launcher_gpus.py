"""GPU discovery and assignment in the launcher (pdserve/launch/gpus.py), and `--kv-connector nixl` in the plan:
fake nvidia-smi output and environments, exact CUDA_VISIBLE_DEVICES / --gpu-memory-utilization per worker, the
refusals, and the CPU plan left exactly as it was when no GPU is found."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import build_parser, config_from_args, describe_devices
from pdserve.launch.commands import worker_argv, worker_env
from pdserve.launch.config import ConfigError, LauncherConfig, WorkerConfig
from pdserve.launch.gpus import (
    GpuSlot,
    assign_gpus,
    discover_gpus,
    parse_nvidia_smi_list,
    parse_visible_devices,
)
from pdserve.launch.plan import dry_run_ports, make_plan, worker_command

SMI_H200x4 = """GPU 0: NVIDIA H200 (UUID: GPU-1d7a3c2e-0000-0000-0000-000000000000)
GPU 1: NVIDIA H200 (UUID: GPU-1d7a3c2e-0000-0000-0000-000000000001)
GPU 2: NVIDIA H200 (UUID: GPU-1d7a3c2e-0000-0000-0000-000000000002)
GPU 3: NVIDIA H200 (UUID: GPU-1d7a3c2e-0000-0000-0000-000000000003)
"""
SMI_MIG = """GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaaaaaa-0000-0000-0000-000000000000)
  MIG 3g.20gb     Device  0: (UUID: MIG-11111111-2222-3333-4444-555555555555)
  MIG 3g.20gb     Device  1: (UUID: MIG-66666666-7777-8888-9999-000000000000)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-bbbbbbbb-0000-0000-0000-000000000000)
"""


def _cfg(tmp_path, **kw) -> LauncherConfig:
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return LauncherConfig(model=str(model), cores=(0, 1), **kw)


# ---------------------------------------------------------------- discovery

def test_parse_visible_devices_like_cuda():
    assert parse_visible_devices("0,1") == ("0", "1")
    assert parse_visible_devices(" 2 , 3 ") == ("2", "3")
    assert parse_visible_devices("GPU-abc,1") == ("GPU-abc", "1")
    assert parse_visible_devices("") == () and parse_visible_devices("-1") == ()
    assert parse_visible_devices("0,-1,2") == ("0",)  # CUDA stops at the first invalid entry


def test_parse_nvidia_smi_list():
    assert parse_nvidia_smi_list(SMI_H200x4) == ("0", "1", "2", "3")
    assert parse_nvidia_smi_list(SMI_MIG) == ("MIG-11111111-2222-3333-4444-555555555555",
                                              "MIG-66666666-7777-8888-9999-000000000000", "1")
    assert parse_nvidia_smi_list("No devices were found\n") == ()
    assert parse_nvidia_smi_list("") == ()


def test_discover_prefers_cuda_visible_devices_and_never_needs_nvidia_smi_then():
    calls = []

    def smi(args):
        calls.append(args)
        return SMI_H200x4

    assert discover_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, smi) == ("2", "3")
    assert discover_gpus({"CUDA_VISIBLE_DEVICES": ""}, smi) == ()  # set but empty: no GPU, as CUDA sees it
    assert calls == []
    assert discover_gpus({}, smi) == ("0", "1", "2", "3") and calls == [["-L"]]
    assert discover_gpus({}, lambda args: None) == ()  # no nvidia-smi / it failed: a CPU host


def test_discover_without_nvidia_smi_on_path(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert discover_gpus() == ()


# ---------------------------------------------------------------- assignment

def test_assign_own_gpus():
    assert assign_gpus(2, ("0", "1", "2")) == [GpuSlot(("0",)), GpuSlot(("1",))]
    assert assign_gpus(2, ("0", "1", "2", "3"), per_worker=2) == [GpuSlot(("0", "1")), GpuSlot(("2", "3"))]
    assert assign_gpus(1, ("0",), memory_utilization=0.8) == [GpuSlot(("0",), 0.8)]
    assert assign_gpus(3, ()) == [GpuSlot()] * 3  # no GPU: CPU slots


def test_assign_shared_splits_memory_evenly():
    assert assign_gpus(2, ("0",), share=True) == [GpuSlot(("0",), 0.45), GpuSlot(("0",), 0.45)]
    assert assign_gpus(3, ("0",), share=True, memory_utilization=0.9) == [GpuSlot(("0",), 0.3)] * 3
    slots = assign_gpus(3, ("0", "1"), share=True, memory_utilization=0.8)
    assert slots == [GpuSlot(("0",), 0.4), GpuSlot(("1",), 0.8), GpuSlot(("0",), 0.4)]
    # shares never add up to more than asked (floored to 3 decimals)
    assert sum(s.memory_utilization or 0 for s in assign_gpus(7, ("0",), share=True)) <= 0.9
    assert assign_gpus(7, ("0",), share=True)[0].memory_utilization == 0.128
    # share with enough GPUs: everyone alone, vLLM's default
    assert assign_gpus(2, ("0", "1"), share=True) == [GpuSlot(("0",)), GpuSlot(("1",))]


def test_assign_refusals_are_actionable():
    with pytest.raises(ConfigError, match=r"3 worker\(s\) x 1 GPU\(s\) each need 3 GPUs but only 2 GPU\(s\) found "
                                          r"\(0,1\): pass --share-gpu"):
        assign_gpus(3, ("0", "1"))
    with pytest.raises(ConfigError, match="gpus_per_worker=4 but only 2 GPU"):
        assign_gpus(1, ("0", "1"), per_worker=4)
    with pytest.raises(ConfigError, match="0.045 each is too little"):
        assign_gpus(20, ("0",), share=True)


# ---------------------------------------------------------------- the plan on GPUs

def test_plan_gives_each_worker_its_gpu(tmp_path):
    cfg = _cfg(tmp_path, prefill=2, decode=1, gpus=("0", "1", "2", "3"))
    plan = make_plan(cfg, cfg.model_dir)
    envs = {p.name: p.env for p in plan.of_kind("worker")}
    assert [envs[n]["CUDA_VISIBLE_DEVICES"] for n in ("prefill0", "prefill1", "decode0")] == ["0", "1", "2"]
    for p in plan.of_kind("worker"):
        assert "VLLM_CPU_KVCACHE_SPACE" not in p.env and "VLLM_CPU_OMP_THREADS_BIND" not in p.env
        assert "--gpu-memory-utilization" not in p.argv and "--tensor-parallel-size" not in p.argv
        assert p.secret  # pdserve's connector: the transfer secret
        kv = json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "PdserveConnector"


def test_plan_shared_gpu_one_box_1p1d(tmp_path):
    cfg = _cfg(tmp_path, gpus=("0",), share_gpu=True, gpu_memory_utilization=0.8)
    plan = make_plan(cfg, cfg.model_dir)
    for p in plan.of_kind("worker"):
        assert p.env["CUDA_VISIBLE_DEVICES"] == "0"
        i = p.argv.index("--gpu-memory-utilization")
        assert p.argv[i + 1] == "0.4"


def test_plan_refuses_more_gpus_than_found(tmp_path):
    with pytest.raises(ConfigError, match="need 2 GPUs but only 1 GPU"):
        _cfg(tmp_path, gpus=("0",))
    with pytest.raises(ConfigError, match="on a GPU host every worker gets gpus_per_worker GPUs"):
        _cfg(tmp_path, gpus=("0", "1", "2", "3"), gpus_per_worker=1, prefill_tp=2)
    with pytest.raises(ConfigError, match="supports TP=1 workers only; add --no-pool"):
        _cfg(tmp_path, gpus=("0", "1", "2", "3"), gpus_per_worker=2, pool=True)
    with pytest.raises(ConfigError, match="lists a GPU twice"):
        _cfg(tmp_path, gpus=("0", "0"))
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1.5: .* in \(0, 1\]"):
        _cfg(tmp_path, gpus=("0", "1"), gpu_memory_utilization=1.5)


def test_tensor_parallel_gpu_workers_with_pdserve_connector(tmp_path):
    cfg = _cfg(tmp_path, gpus=("0", "1", "2", "3"), gpus_per_worker=2)
    assert cfg.pool is False  # the KV pool needs TP=1: off by default
    plan = make_plan(cfg, cfg.model_dir)
    p0, d0 = plan.process("prefill0"), plan.process("decode0")
    assert p0.env["CUDA_VISIBLE_DEVICES"] == "0,1" and d0.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    for p in (p0, d0):
        i = p.argv.index("--tensor-parallel-size")
        assert p.argv[i + 1] == "2"
        assert "VLLM_CPU_OMP_THREADS_BIND" not in p.env
        assert "--dtype" not in p.argv  # the CPU dtype rule is not applied to GPU workers: vLLM's default


def test_tensor_parallel_workers_with_nixl(tmp_path):
    cfg = _cfg(tmp_path, gpus=("0", "1", "2", "3"), gpus_per_worker=2, kv_connector="nixl")
    plan = make_plan(cfg, cfg.model_dir)
    p0, d0 = plan.process("prefill0"), plan.process("decode0")
    assert p0.env["CUDA_VISIBLE_DEVICES"] == "0,1" and d0.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert p0.argv[p0.argv.index("--tensor-parallel-size") + 1] == "2"
    kv = json.loads(p0.argv[p0.argv.index("--kv-transfer-config") + 1])
    assert kv["kv_buffer_device"] == "cuda"


def test_gpus_from_yaml_and_mapping(tmp_path):
    cfg = _cfg(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {cfg.model}\ngpus: [0, 1]\nshare_gpu: false\n")
    assert LauncherConfig.from_yaml(path).gpus == ("0", "1")
    path.write_text(f"model: {cfg.model}\ngpus: none\n")
    assert LauncherConfig.from_yaml(path).gpus == ()
    assert LauncherConfig.from_mapping({"model": cfg.model, "gpus": "2,3"}).gpus == ("2", "3")


# ---------------------------------------------------------------- the CPU plan is unchanged

def test_no_gpu_found_keeps_the_cpu_plan_byte_identical(tmp_path):
    cfg = _cfg(tmp_path)
    args = build_parser().parse_args(["serve", "--model", cfg.model, "--cores", "0,1"])
    found = config_from_args(args, discover=lambda: ())
    assert found == cfg
    a, b = make_plan(cfg, cfg.model_dir), make_plan(found, found.model_dir)
    assert a.processes == b.processes
    for p in a.of_kind("worker"):
        assert "CUDA_VISIBLE_DEVICES" not in p.env and "--gpu-memory-utilization" not in p.argv
        assert list(p.env)[:2] == ["VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"]
    assert describe_devices(cfg, a) == "kv connector: pdserve; gpus: none found (CPU workers)"
    # worker_command outside a plan: same argv and env as before (no GPU, pdserve connector)
    w = WorkerConfig(role="prefill", index=0, model="/m", port=8100, cores=(0,))
    argv, env = worker_command(w, "s" * 64, base_env={})
    assert "--gpu-memory-utilization" not in argv and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_cli_discovers_unless_told(tmp_path):
    cfg = _cfg(tmp_path)
    base = ["serve", "--model", cfg.model, "--cores", "0,1"]
    found = config_from_args(build_parser().parse_args(base + ["--share-gpu"]), discover=lambda: ("0",))
    assert found.gpus == ("0",) and found.share_gpu
    auto = config_from_args(build_parser().parse_args(base + ["--gpus", "auto"]), discover=lambda: ("0", "1"))
    assert auto.gpus == ("0", "1")

    def never():
        raise AssertionError("discovery must not run when --gpus names the GPUs")

    assert config_from_args(build_parser().parse_args(base + ["--gpus", "none"]), discover=never).gpus == ()
    assert config_from_args(build_parser().parse_args(base + ["--gpus", "3,4"]), discover=never).gpus == ("3", "4")
    path = tmp_path / "c.yaml"
    path.write_text("gpus: [5, 6]\n")
    from_file = config_from_args(build_parser().parse_args(base + ["--config", str(path)]), discover=never)
    assert from_file.gpus == ("5", "6")
    path.write_text("gpus: auto\n")  # a file may ask for discovery too
    assert config_from_args(build_parser().parse_args(base + ["--config", str(path)]),
                            discover=lambda: ("7", "8")).gpus == ("7", "8")
    assert config_from_args(build_parser().parse_args(base + ["--config", str(path)]), discover=lambda: ()).gpus == ()
    with pytest.raises(ConfigError, match="need 2 GPUs but only 1"):
        config_from_args(build_parser().parse_args(base), discover=lambda: ("0",))


# ---------------------------------------------------------------- --kv-connector nixl

def test_nixl_plan_workers_router_and_ports(tmp_path):
    cfg = _cfg(tmp_path, kv_connector="nixl", lease_s=12.5, connector_extra={"backends": ["UCX"]})
    assert cfg.pool is False  # the KV pool works through pdserve's connector only
    ports = dry_run_ports(cfg)
    assert ports.side_channels == (ports.workers[-1] + 1, ports.workers[-1] + 2)
    plan = make_plan(cfg, cfg.model_dir)
    assert plan.pool is None and not plan.of_kind("pool")
    for w, p, side in zip(plan.workers, plan.of_kind("worker"), ports.side_channels):
        kv = json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
        assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
                      "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": {"kv_lease_duration": 13, "backends": ["UCX"]}}
        assert p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(side) == str(w.nixl_side_channel_port)
        assert p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        # CPU workers: NIXL's progress threads idle, and the worker's cores kept across NixlConnector's constructor
        assert p.env["PDSERVE_NIXL_PROGRESS"] == "idle" and p.env["PDSERVE_NIXL_KEEP_CORES"] == "1"
        assert not p.secret  # NixlConnector has no use for pdserve's transfer secret
    r = plan.router.argv
    assert r[r.index("--kv-connector") + 1] == "nixl"
    assert "--kv-connector" not in make_plan(_cfg(tmp_path), cfg.model_dir).router.argv


def test_nixl_side_channel_host_from_env_wins(tmp_path):
    w = WorkerConfig(role="decode", index=0, model="/m", port=8100, cores=(0,), kv_connector="nixl",
                     nixl_side_channel_port=5601, env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3"})
    assert worker_env(w)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"
    assert "NixlConnector" in " ".join(worker_argv(w))


def test_nixl_refusals(tmp_path):
    with pytest.raises(ConfigError, match="pool=true with kv_connector='nixl'"):
        _cfg(tmp_path, kv_connector="nixl", pool=True)
    with pytest.raises(ConfigError, match="kv_connector='lmcache': choose pdserve"):
        _cfg(tmp_path, kv_connector="lmcache")
    with pytest.raises(ConfigError, match="nixl_side_channel_port=0"):
        WorkerConfig(role="decode", index=0, model="/m", cores=(0,), kv_connector="nixl")
    # colocated without a connector: the data plane does not matter, and no side-channel port is needed
    plain = _cfg(tmp_path, colocated=1, kv_connector="nixl")
    assert dry_run_ports(plain).side_channels == ()
    assert "--kv-transfer-config" not in make_plan(plain, plain.model_dir).process("colocated0").argv


def test_nixl_cpu_workers_run_nixl_progress_threads_at_idle_priority(monkeypatch):
    """NIXL's UCX progress thread spins (poll delay 0): CPU workers get PDSERVE_NIXL_PROGRESS=idle (the vLLM plugin
    pdserve/vllm/nixl_progress.py then sets it to SCHED_IDLE); GPU workers keep NIXL's default; a set value wins."""
    from pdserve.vllm.nixl_progress import ENV

    monkeypatch.delenv(ENV, raising=False)

    def env(**kw):
        return worker_env(WorkerConfig(role="decode", index=0, model="/m", port=8100, kv_connector="nixl",
                                       nixl_side_channel_port=5601, **kw))

    assert env(cores=(0,))[ENV] == "idle"
    assert ENV not in env(cores=(0,), gpus=("0",))
    assert env(cores=(0,), env={ENV: "off"})[ENV] == "off"
    monkeypatch.setenv(ENV, "off")  # the launcher's own environment: the workers inherit it
    assert ENV not in env(cores=(0,))
