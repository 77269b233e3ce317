"""What a launch runs, as data: config + ports -> every process's argv and environment, in start order.

    plan = make_plan(config, model_dir, ports=allocate_ports(config), run_dir=run_dir)   # a real launch
    print(make_plan(config, model_dir).describe())                                     # pdserve serve --dry-run

:func:`make_plan` is pure: it opens no socket and reads no environment. The ports come in as a :class:`Ports`
(:func:`dry_run_ports` numbers them from the config's base port; :func:`pdserve.launch.cluster.allocate_ports`
takes free ones), the KV pool is an explicit :class:`PoolPlan`, and whether a process gets the launch's
transfer secret is a field of its :class:`ProcessSpec`, decided here from the config. The cluster
(:mod:`pdserve.launch.cluster`) runs the specs; nothing reads a command line back.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..dtype import DtypeChoice, choose_dtype
from ..settings.speculative import speculative_roles
from .commands import (
    INDEXER_SNAPSHOT,
    indexer_argv,
    pool_master_argv,
    pool_node_argv,
    router_command,
    served_name,
    worker_argv,
    worker_env,
)
from .config import SECRET_ENV, ConfigError, LauncherConfig, WorkerConfig
from .config_devices import worker_tp
from .config_experts import worker_dp, worker_ep
from .config_gpus import GpuSlot, assign_gpus
from .mooncake import STORE_CONFIG_FILE, mooncake_master_argv, mooncake_store_config
from .plane_limits import check_mla_rotary, check_plane
from .pool_note import check_pool_model
from .procs import assign_cores, available_cores

REPO_ROOT = Path(__file__).resolve().parents[2]
POOL_HOST = "127.0.0.1"  # the KV pool master and node run on this host, next to the workers
DEFAULT_BASE_PORT = 8000  # a dry run with port=0 numbers its ports from here
MEMBERSHIP_FILE = "membership.json"  # in the run folder: run-time membership the router processes share


def router_name(i: int) -> str:
    """``router`` for the first router process, ``router1``, ``router2``, ... for the other replicas."""
    return "router" if i == 0 else f"router{i}"


@dataclass(frozen=True)
class Ports:
    """Every port a launch listens on (the workers' KV event publishers bind Unix sockets, no port: see
    :func:`kv_events_prefix`). pool / pool_metrics: the KV pool master's RPC and metrics ports (0 without a
    pool); side_channels: one port per worker for vLLM's connector to meet its peers on: NixlConnector's
    handshake listener (``--kv-connector nixl``) or MooncakeConnector's bootstrap server (``--kv-connector
    mooncake``); else empty."""

    router: int
    workers: tuple[int, ...]
    pool: int = 0
    pool_metrics: int = 0
    side_channels: tuple[int, ...] = ()
    indexer: int = 0  # the KV indexer's HTTP port (--start-indexer), 0 without one

    def all(self) -> tuple[int, ...]:
        return tuple(p for p in (self.router, *self.workers, self.pool, self.pool_metrics, *self.side_channels,
                                 self.indexer) if p)


def wants_side_channels(config: LauncherConfig) -> bool:
    """Workers that load vLLM's NixlConnector each need a handshake port (VLLM_NIXL_SIDE_CHANNEL_PORT), those
    that load its MooncakeConnector a bootstrap server port (VLLM_MOONCAKE_BOOTSTRAP_PORT)."""
    return bool(config.connector) and config.kv_connector in ("nixl", "mooncake")


def wants_kv_events(config: LauncherConfig) -> bool:
    """The workers publish KV cache events to the router only when the conductor places requests."""
    return config.policy == "conductor"


IPC_PATH_MAX = 100  # a Unix socket path holds ~107 bytes; leave room for the worker's name


def kv_events_prefix(run_dir: str | os.PathLike) -> str:
    """Where the workers' KV event publishers bind their Unix sockets (``<prefix><worker>.kvpub`` / ``.kvrpl``):
    the run folder, or a name under /tmp derived from it when its path is too long for a socket address."""
    prefix = f"{run_dir}/"
    if len(prefix) + len("colocated99.kvpub") <= IPC_PATH_MAX:
        return prefix
    return f"/tmp/pdserve-kv-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]}-"


def kv_event_endpoints(prefix: str, worker: str) -> tuple[str, str]:
    """The (publisher, replay) endpoints one worker's vLLM binds (ipc://: vLLM binds, every router connects)."""
    return f"ipc://{prefix}{worker}.kvpub", f"ipc://{prefix}{worker}.kvrpl"


def dry_run_ports(config: LauncherConfig) -> Ports:
    """Ports numbered from the config's base port (``port``, or 8000 when 0): router, workers, pool metrics,
    pool master (``pool_port`` when set). Deterministic and socket-free: for ``--dry-run``."""
    base = config.port or DEFAULT_BASE_PORT
    reserved = {base, config.pool_port} - {0}

    def numbers() -> Iterator[int]:
        p = base
        while True:
            p += 1
            if p not in reserved:
                yield p

    nxt = numbers()
    workers = tuple(next(nxt) for _ in range(config.num_workers))
    pool_metrics = pool = 0
    if config.pool:
        pool_metrics = next(nxt)
        pool = config.pool_port or next(nxt)
    side = tuple(next(nxt) for _ in range(config.num_workers)) if wants_side_channels(config) else ()
    return Ports(base, workers, pool, pool_metrics, side, next(nxt) if config.start_indexer else 0)


@dataclass(frozen=True)
class PoolPlan:
    """The KV pool a launch starts: pdserve's (a master and one store node on this host) or Mooncake Store
    (``backend`` mooncake: ``mooncake_master`` on this host, each worker lending ``mem``; ``store_config``: the file
    the workers' MooncakeStoreConnector reads, whose text is ``store_config_text``)."""

    port: int
    metrics_port: int
    mem: str
    disk: str
    disk_dir: str
    owns_disk_dir: bool  # the launch made disk_dir (in its run folder) and removes it at stop
    backend: str = "pdserve"
    store_config: str = ""
    store_config_text: str = ""

    @property
    def master(self) -> str:
        return f"{POOL_HOST}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{POOL_HOST}:{self.metrics_port}"


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start. env: the variables the launcher sets on top of its own environment; secret: the
    process gets the launch's transfer secret in ``$PDSERVE_TRANSFER_SECRET`` (every other process has it
    removed); url: where it answers (health or metrics; "" none); listen_port: the port to wait for before the
    next process starts (0: do not wait)."""

    name: str
    kind: str  # "pool" | "worker" | "router"
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    secret: bool = False
    url: str = ""
    listen_port: int = 0

    def environ(self, base: Mapping[str, str], secret: str = "") -> dict[str, str]:
        """The full environment: ``base`` + :attr:`env`, pdserve first on PYTHONPATH, the secret or none."""
        env = dict(base)
        env.update(self.env)
        env["PYTHONPATH"] = _prepend_path(str(REPO_ROOT), env.get("PYTHONPATH", ""))
        env.pop(SECRET_ENV, None)
        if self.secret:
            if not secret:
                raise ValueError(f"{self.name} needs the launch's transfer secret")
            env[SECRET_ENV] = secret
        return env


def _prepend_path(entry: str, path: str) -> str:
    parts = [p for p in path.split(os.pathsep) if p and p != entry]
    return os.pathsep.join([entry, *parts])


@dataclass(frozen=True)
class Plan:
    """What a launch will run (``pdserve serve --dry-run`` prints it): processes in start order (pool master,
    pool node, workers, router)."""

    model_dir: Path
    model_name: str
    workers: tuple[WorkerConfig, ...]
    ports: Ports
    pool: PoolPlan | None
    processes: tuple[ProcessSpec, ...]

    @property
    def router_port(self) -> int:
        return self.ports.router

    @property
    def pool_port(self) -> int:
        return self.pool.port if self.pool else 0

    @property
    def router(self) -> ProcessSpec:
        return self.process("router")

    @property
    def router_argv(self) -> tuple[str, ...]:
        return self.router.argv

    def process(self, name: str) -> ProcessSpec:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r} in this plan ({', '.join(p.name for p in self.processes)})")

    def of_kind(self, kind: str) -> list[ProcessSpec]:
        return [p for p in self.processes if p.kind == kind]

    def describe(self, secret_placeholder: str = "<generated per launch>") -> str:
        """One line per process: ``[name] VAR=value ... argv`` (the variables the launcher sets)."""
        lines = []
        for p in self.processes:
            words = [f"{k}={shlex.quote(v)}" for k, v in p.env.items() if k != "PYTHONUNBUFFERED"]
            if p.secret:
                words.append(f"{SECRET_ENV}={secret_placeholder}")
            lines.append(f"[{p.name}] {' '.join([*words, shlex.join(p.argv)])}")
        return "\n".join(lines)

    def describe_ports(self) -> str:
        p = self.ports
        parts = [f"router {p.router}"]
        parts += [f"{w.name} {w.port}" for w in self.workers]
        if self.pool:
            parts.append(f"pool master {self.pool.port} (metrics {self.pool.metrics_port})")
        return "ports: " + ", ".join(parts)


def plan_workers(
    config: LauncherConfig,
    model_dir: str | os.PathLike,
    ports: Sequence[int] | None = None,
    cores: Sequence[int] | None = None,
    kv_events_prefix: str = "",
    pool_master: str = "",
    side_channels: Sequence[int] | None = None,
) -> list[WorkerConfig]:
    """One WorkerConfig per worker: prefill workers first, then decode (or the colocated, or the elastic ones).

    ports: one per worker (default: :func:`dry_run_ports`); cores: the pool to spread workers over (default:
    ``config.cores`` or this process's CPU affinity), ``config.cores_per_worker`` each, round-robin;
    kv_events_prefix: where each worker's KV event publisher binds (:func:`kv_events_prefix`; "" no KV
    events); pool_master: HOST:PORT of the KV pool master every connector saves to and loads from ("" none);
    side_channels: one NixlConnector handshake (or MooncakeConnector bootstrap) port per worker (default:
    :func:`dry_run_ports`'s). GPUs: ``config.gpus`` split by
    :func:`pdserve.launch.gpus.assign_gpus` (none: CPU workers, exactly as before).
    """
    if config.colocated:
        roles = [("colocated", i) for i in range(config.colocated)]
    elif config.elastic:
        roles = [("elastic", i) for i in range(config.elastic)]
    else:
        roles = [("prefill", i) for i in range(config.prefill or 0)] + [("decode", i) for i in
                                                                      range(config.decode or 0)]
    pool = tuple(cores) if cores is not None else (config.cores or available_cores())
    if config.cores_per_worker > len(pool):
        raise ConfigError(
            f"cores_per_worker={config.cores_per_worker} but only {len(pool)} cores available {pool}; "
            "lower cores_per_worker"
        )
    bindings = assign_cores(len(roles), pool, config.cores_per_worker)
    tps = [worker_tp(config, role) for role, _ in roles]
    if any(tp > 1 for tp in tps):  # tensor parallel: cores_per_worker cores for each rank of a worker
        bindings = assign_rank_cores([tp * config.cores_per_worker for tp in tps], pool)
    ports = dry_run_ports(config).workers if ports is None else tuple(ports)
    if len(ports) != len(roles):
        raise ValueError(f"need {len(roles)} ports, got {len(ports)}")
    name = served_name(config, model_dir)
    extra_config = dict(config.connector_extra)
    if not config.kv_checksum:
        extra_config["kv_checksum"] = False
    if not config.layerwise_kv:
        extra_config["layerwise_kv"] = False
    if pool_master:
        extra_config["pool_master"] = pool_master
    role_args = {"prefill": tuple(config.prefill_args), "decode": tuple(config.decode_args), "colocated": (),
                 "elastic": ()}
    slots = assign_gpus(len(roles), config.gpus, config.gpus_per_worker, config.share_gpu,
                        config.gpu_memory_utilization)
    side: tuple[int, ...] = ()
    if wants_side_channels(config):
        side = dry_run_ports(config).side_channels if side_channels is None else tuple(side_channels)
        if len(side) != len(roles):
            raise ValueError(f"need {len(roles)} {config.kv_connector} side-channel ports, got {len(side)}")
        extra_config = dict(config.connector_extra)  # vLLM's connector's own settings: no pdserve pool
    workers = [
        WorkerConfig(
            role=role, index=index, model=str(model_dir), port=port, host=config.worker_host, cores=bind,
            kv_cache_gib=config.kv_cache_gib, max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens, stream_interval=config.stream_interval,
            dtype=worker_dtype(config.dtype).dtype,
            speculative_config=config.speculative_config if role in speculative_roles(config.speculative_config)
            else "", expert_parallel=worker_ep(config, role), dp=worker_dp(config, role),
            served_model_name=name, enable_lora=config.enable_lora, lora_modules=config.lora_modules,
            max_lora_rank=config.max_lora_rank, max_loras=config.max_loras,
            connector=bool(config.connector), lease_s=config.lease_s, connector_extra=dict(extra_config),
            extra_args=tuple(config.worker_args) + role_args[role], env=dict(config.env),
            tp=tp, otlp_traces_endpoint=config.otlp_traces_endpoint,
        )
        for (role, index), port, bind, tp in zip(roles, ports, bindings, tps)
    ]
    if kv_events_prefix:
        workers = [_publishing(w, kv_events_prefix) for w in workers]
    return [_on_gpus_and_plane(w, config, slot, side[i] if side else 0) for i, (w, slot) in
            enumerate(zip(workers, slots))]


def _publishing(worker: WorkerConfig, prefix: str) -> WorkerConfig:
    endpoint, replay = kv_event_endpoints(prefix, worker.name)
    return replace(worker, kv_events_endpoint=endpoint, kv_events_replay=replay)


def _on_gpus_and_plane(worker: WorkerConfig, config: LauncherConfig, slot: GpuSlot, side_port: int
                       ) -> WorkerConfig:
    """A worker with its GPU slot and data plane; a CPU worker on pdserve's connector is returned as it was."""
    if not slot.devices and config.kv_connector == "pdserve":
        return worker
    tp = config.gpus_per_worker // worker.dp if slot.devices else worker.tp  # on GPUs: a GPU per rank (TP x DP)
    # the CPU dtype rule (pdserve.dtype) is for CPU workers: a GPU worker keeps vLLM's default unless --dtype
    dtype = worker.dtype if not slot.devices or config.dtype else None
    side = side_port if worker.connector else 0
    return replace(worker, gpus=slot.devices, gpu_memory_utilization=slot.memory_utilization,
                   tp=tp, kv_connector=config.kv_connector, dtype=dtype, mooncake_protocol=config.mooncake_protocol,
                   nixl_side_channel_port=side if config.kv_connector == "nixl" else 0,
                   mooncake_bootstrap_port=side if config.kv_connector == "mooncake" else 0)


def assign_rank_cores(widths: Sequence[int], pool: Sequence[int]) -> list[tuple[int, ...]]:
    """Worker i gets ``widths[i]`` consecutive entries of ``pool`` after worker i-1's, wrapping (so a TP=2
    worker on two cores gets both, and the next worker shares them)."""
    if not pool:
        raise ValueError("no CPU cores to assign")
    out, start = [], 0
    for w in widths:
        out.append(tuple(pool[(start + j) % len(pool)] for j in range(w)))
        start += w
    return out


def plan_pool(config: LauncherConfig, ports: Ports, run_dir: str | os.PathLike) -> PoolPlan | None:
    """The KV pool (``config.pool``): its SSD tier in ``pool_disk_dir``, else in the run folder (then ours)."""
    if not config.pool:
        return None
    if not ports.pool or not ports.pool_metrics:
        raise ValueError(f"a launch with the KV pool needs its master's ports; got {ports}")
    if config.pool_backend == "mooncake":
        text = mooncake_store_config(f"{POOL_HOST}:{ports.pool}", config.pool_mem, config.mooncake_protocol)
        return PoolPlan(ports.pool, ports.pool_metrics, config.pool_mem, "0", "", False, "mooncake",
                        str(Path(run_dir) / STORE_CONFIG_FILE), text)
    own = not config.pool_disk_dir
    disk_dir = str(Path(run_dir) / "pool-ssd") if own else str(Path(config.pool_disk_dir).expanduser())
    return PoolPlan(ports.pool, ports.pool_metrics, config.pool_mem, config.pool_disk, disk_dir, own)


def make_plan(
    config: LauncherConfig,
    model_dir: str | os.PathLike,
    ports: Ports | None = None,
    run_dir: str | os.PathLike = "<run dir>",
    cores: Sequence[int] | None = None,
    python: str = sys.executable,
) -> Plan:
    """Every process of a launch, in start order. ``ports`` default: :func:`dry_run_ports` (no socket)."""
    model_dir = Path(model_dir)
    ports = dry_run_ports(config) if ports is None else ports
    if len(ports.workers) != config.num_workers:
        raise ValueError(f"need {config.num_workers} worker ports, got {ports.workers}")
    pool = plan_pool(config, ports, run_dir)
    events = kv_events_prefix(run_dir) if wants_kv_events(config) else ""
    if wants_side_channels(config) and len(ports.side_channels) != config.num_workers:
        raise ValueError(f"--kv-connector {config.kv_connector} needs {config.num_workers} side-channel ports, "
                         f"got {ports}")
    own_pool = pool is not None and pool.backend == "pdserve"
    workers = plan_workers(config, model_dir, ports.workers, cores, events, pool.master if pool and own_pool else "",
                           ports.side_channels)
    check_plane(config, workers, model_dir)  # a data plane that would answer wrong tokens is refused here
    check_mla_rotary(config, workers, model_dir)  # ... and MLA on CPU where vLLM's rotary kernel would
    check_pool_model(config, model_dir)  # a pool whose connector would refuse the model at every worker's start
    if pool is not None and pool.backend == "mooncake":
        workers = [replace(w, mooncake_store_config=pool.store_config) if w.connector else w for w in workers]
    processes: list[ProcessSpec] = []
    base_env = {"PYTHONUNBUFFERED": "1"}
    if pool is not None and pool.backend == "mooncake":
        processes.append(ProcessSpec("mooncake-master", "pool", tuple(mooncake_master_argv(
            pool.port, pool.metrics_port, POOL_HOST, python)), base_env, url=pool.metrics_url,
            listen_port=pool.port))
    elif pool is not None:
        processes.append(ProcessSpec("pool-master", "pool", tuple(pool_master_argv(pool.port, pool.metrics_port,
                                                                                   python)),
                                     base_env, secret=True, url=pool.metrics_url, listen_port=pool.port))
        processes.append(ProcessSpec("pool-node", "pool", tuple(pool_node_argv(pool.master, pool.mem, pool.disk,
                                                                               pool.disk_dir, python)),
                                     base_env, secret=True))
    for w in workers:
        processes.append(ProcessSpec(w.name, "worker", tuple(worker_argv(w, python)), worker_env(w),
                                     secret=_needs_secret(w), url=w.url))
    # the conductor follows the pool's event log (pooled prefixes count as loadable); it authenticates to the
    # master with the secret, which is the router's only use for it (it never touches KV bytes)
    follows_pool = own_pool and config.policy == "conductor"
    indexer = f"http://{POOL_HOST}:{ports.indexer}" if config.start_indexer else ""
    if indexer:  # before the routers, which seed from it when they start
        processes.append(ProcessSpec("indexer", "indexer", tuple(indexer_argv(
            workers, ports.indexer, f"{run_dir}/{INDEXER_SNAPSHOT}", pool.master if pool and follows_pool else "",
            python)), base_env, secret=follows_pool, url=indexer, listen_port=ports.indexer))
    router_argv = router_command(config, workers, model_dir, ports.router, python, indexer=indexer,
                                 pool_master=pool.master if pool is not None and follows_pool else "",
                                 membership_file=f"{run_dir}/{MEMBERSHIP_FILE}",
                                 mooncake_store=f"{POOL_HOST}:{pool.metrics_port}" if pool is not None
                                 and pool.backend == "mooncake" and config.policy == "conductor" else "")
    for i in range(config.routers):  # replicas share the port (SO_REUSEPORT) and the membership file
        processes.append(ProcessSpec(router_name(i), "router", tuple(router_argv), base_env, secret=follows_pool,
                                     url=f"http://{config.host}:{ports.router}"))
    return Plan(model_dir, served_name(config, model_dir), tuple(workers), ports, pool, tuple(processes))


def worker_command(worker: WorkerConfig, secret: str | None = None, base_env: Mapping[str, str] | None = None,
                   python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """argv and full environment of one vLLM worker outside a plan (e.g. a worker started by hand in a test);
    ``base_env`` default: this process's environment."""
    spec = ProcessSpec(worker.name, "worker", tuple(worker_argv(worker, python)), worker_env(worker),
                       secret=_needs_secret(worker))
    return list(spec.argv), spec.environ(os.environ if base_env is None else base_env, secret or "")


def _needs_secret(worker: WorkerConfig) -> bool:
    """pdserve's connector authenticates its transfer engine with the launch's secret; NixlConnector has none."""
    return worker.connector and worker.kv_connector == "pdserve"


def router_env(base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of a router started outside a plan: no transfer secret, pdserve first on PYTHONPATH."""
    spec = ProcessSpec("router", "router", (), {"PYTHONUNBUFFERED": "1"})
    return spec.environ(os.environ if base_env is None else base_env)


def worker_dtype(configured: str | None) -> DtypeChoice:
    """The workers' ``--dtype``: as configured (already checked by the config, passed to vLLM as is), else the
    CPU rule's (:func:`pdserve.dtype.choose_dtype`: bf16 with AVX512-BF16 or AMX, else fp32)."""
    if configured:
        return DtypeChoice(configured, f"--dtype {configured} given")
    return choose_dtype()
