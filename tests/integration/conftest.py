"""Fixtures that start real processes on 127.0.0.1 and always stop them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from pdserve.launch.procs import pids_in_group, spawn, wait_dead

ROOT = Path(__file__).resolve().parents[2]
SECRET = "integration-test-secret"


class PeerProcess:
    """A transfer engine in a child process (tests/integration/transfer_peer.py)."""

    def __init__(self, size: int, seed: int, secret: str = SECRET, backend: str = "auto") -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        script = str(Path(__file__).with_name("transfer_peer.py"))
        self.proc = subprocess.Popen(
            [sys.executable, script, str(size), str(seed), secret, backend],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        line = self.proc.stdout.readline()
        while line and not line.startswith("{"):  # skip third-party log lines (NIXL logs to stdout)
            line = self.proc.stdout.readline()
        self.descriptor = json.loads(line)

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def sha(self, offset: int, length: int) -> str:
        return self.ask(f"sha {offset} {length}")

    def notes(self) -> list:
        return json.loads(self.ask("notes"))

    def alive(self) -> bool:
        return self.proc.poll() is None and self.ask("ping") == "pong"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


@pytest.fixture
def spawn_peer():
    peers: list[PeerProcess] = []

    def spawn(size: int, seed: int = 0, secret: str = SECRET, backend: str = "auto") -> PeerProcess:
        peer = PeerProcess(size, seed, secret, backend)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.stop()


def membership_router(tmp_path_factory, name: str, token: str, health_interval_s: float):
    """A real router (``python -m pdserve.router``, tiny random Llama, no workers yet) whose membership API takes
    ``token``; yields its URL once the API answers and stops it afterwards. For module fixtures."""
    import time

    from pdserve.kube.discovery import HttpRouterApi, RouterApiError
    from pdserve.launch.models import build_random_llama
    from pdserve.launch.procs import free_port

    model = build_random_llama(tmp_path_factory.mktemp(f"{name}-model") / "random-llama")
    port = free_port()
    log = tmp_path_factory.mktemp(f"{name}-logs") / "router.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_ADMIN_TOKEN=token, PYTHONUNBUFFERED="1")
    proc = spawn("router", [sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(port),
                            "--model-dir", str(model), "--mode", "disaggregated", "--served-model-name", "rl",
                            "--max-model-len", "2048", "--health-interval-s", str(health_interval_s)],
                 env=env, log_path=log, cwd=ROOT).proc  # warm-started (tests/conftest.py)
    url = f"http://127.0.0.1:{port}"
    api = HttpRouterApi(url, token=token)
    deadline = time.monotonic() + 120
    while True:
        try:
            api.list_workers()
            break
        except RouterApiError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"router did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


_PD_CLUSTER_LOG: list[str] = []  # the shared 1P1D launch's log lines


@pytest.fixture(scope="session")
def pd_cluster(tmp_path_factory):
    """The 1P1D stack as ``pdserve serve`` starts it (PdserveConnector, the KV pool, the router; fp32 random Llama
    with a Hermes-style tool template, vLLM's hermes tool parser on every worker and the router, and whitespace
    tokens that cannot stall a JSON grammar on random weights).
    Started once per test process and shared by the
    modules listed with it in tests/conftest.py's ``SHARED_STACKS``; they run in that order on one process, so the
    one that kills a worker (test_router_prefill_kill.py) comes last."""
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig
    from pdserve.launch.models import build_random_llama, quiet_whitespace_tokens, use_tool_chat_template

    log = _PD_CLUSTER_LOG  # one list for both fixture definitions (shared_stack)

    def start() -> Cluster:
        model = build_random_llama(tmp_path_factory.mktemp("pd-router-model") / "random-llama")
        model = quiet_whitespace_tokens(use_tool_chat_template(model))
        tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
        cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                             served_model_name="rl", run_dir=str(tmp_path_factory.mktemp("pd-router-run")),
                             worker_timeout_s=400, worker_args=tools, router_args=("--tool-call-parser", "hermes"),
                             pool_disk="64MiB")
        return Cluster(cfg, log=log.append)

    with shared_stack("pd_cluster", start) as c:
        yield c
        pids = sorted({p for g in c.pgids() for p in pids_in_group(g)})
        ssd = Path(c.run_dir) / "pool-ssd"
        assert ssd.is_dir()
    if "pd_cluster" in _SHARED:  # another fixture definition still holds the stack: it checks the stop
        return
    # the launch's stop: every process gone, pool included, on SIGTERM alone; the pool's own SSD folder removed
    assert wait_dead(pids, 30) == [], "processes of the launch left behind"
    assert not any("got SIGKILL" in line for line in log), log
    assert not ssd.exists(), "the launcher's own SSD folder is removed at stop"


_SHARED: dict[str, list] = {}  # stack name -> [its context manager, its value, how many fixtures hold it]


@contextmanager
def shared_stack(name: str, start):
    """One stack per process for every fixture definition of ``name``: tests/conformance/conftest.py imports the
    fixtures above, which makes pytest hold a second definition (its own session cache); both get this one stack,
    stopped when the last of them is torn down."""
    entry = _SHARED.get(name)
    if entry is None:
        manager = start()
        entry = _SHARED[name] = [manager, manager.__enter__(), 0]
    entry[2] += 1
    try:
        yield entry[1]
    finally:
        entry[2] -= 1
        if entry[2] == 0:
            del _SHARED[name]
            entry[0].__exit__(None, None, None)


@pytest.fixture(scope="session")
def otlp_collector(tmp_path_factory):
    """A real OTLP/gRPC trace collector in its own process (tests/integration/otlp_collector.py) for the session's
    traced stack (``pd_faults``)."""
    from .otlp_collector import Collector

    c = Collector(tmp_path_factory.mktemp("otlp"))
    yield c
    c.stop()


@pytest.fixture(scope="session")
def pd_faults(tmp_path_factory, otlp_collector):
    """The 1P2D stack as ``pdserve serve`` starts it with PdserveConnector's test faults allowed (fp32 random Llama
    served as "m", no pool, a router that probes every 0.5 s), traced: the router and every worker send their spans
    to ``otlp_collector`` (``--otlp-traces-endpoint``, spans exported every 0.5 s), so its tests run with tracing on
    and test_tracing_vllm.py reads their traces. Started once per test process and shared by the
    modules listed with it in tests/conftest.py's ``SHARED_STACKS``: the ones that call P and D directly
    (``pd_pair``) first, then test_router_faults.py, which stops and kills workers."""
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig

    from .test_pd_exactness import model_path

    def start() -> Cluster:
        # auto = same-host copy (process_vm_readv); tcp exercises the cross-host path
        extra = {"allow_test_faults": True, "backend": os.environ.get("PDSERVE_TEST_TRANSFER_BACKEND", "auto")}
        cfg = LauncherConfig(model=str(model_path(tmp_path_factory)), prefill=1, decode=2, port=0, dtype="float32",
                             max_model_len=2048, served_model_name="m", run_dir=str(tmp_path_factory.mktemp("pd-faults")),
                             worker_timeout_s=400, pool=False, connector_extra=extra,
                             router_args=("--health-interval-s", "0.5", "--health-timeout-s", "0.5"),
                             otlp_traces_endpoint=otlp_collector.endpoint, env={"OTEL_BSP_SCHEDULE_DELAY": "500"})
        return Cluster(cfg)

    with shared_stack("pd_faults", start) as c:
        yield c


@pytest.fixture(scope="session")
def pd_pair(pd_faults):
    """P and D of the shared 1P2D launch (``pd_faults``: prefill0 and decode0), called directly, without its router,
    by test_kv_integrity.py and test_pd_exactness.py."""
    from .test_pd_exactness import Worker

    children = {c.name: c for c in pd_faults.workers}
    return tuple(Worker(children[name].url, children[name].log_path) for name in ("prefill0", "decode0"))


@pytest.fixture(scope="session")
def pd_conductor(tmp_path_factory):
    """2P1D behind two router replicas on one port, with the conductor's placement and the KV pool, every worker
    loading one random LoRA adapter (lora_pd.ADAPTER; the routers then refuse prompt scoring). Shared by
    test_conductor_vllm.py, then test_lora_vllm.py (tests/conftest.py: ``SHARED_STACKS``)."""
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig
    from pdserve.launch.models import build_random_llama

    from .lora_pd import ADAPTER, RANK, write_random_lora

    def start() -> Cluster:
        model = build_random_llama(tmp_path_factory.mktemp("conductor-model") / "random-llama")
        adapter = write_random_lora(tmp_path_factory.mktemp("conductor-lora") / ADAPTER)
        cfg = LauncherConfig(model=str(model), prefill=2, decode=1, port=0, dtype="float32", max_model_len=2048,
                             served_model_name="rl", run_dir=str(tmp_path_factory.mktemp("conductor-run")),
                             worker_timeout_s=400, policy="conductor", routers=2,
                             lora_modules=f"{ADAPTER}={adapter}", max_lora_rank=RANK, max_loras=2,
                             router_args=("--local-prefill-tokens", "0", "--no-calibrate"))
        return Cluster(cfg)

    with shared_stack("pd_conductor", start) as c:
        yield c
