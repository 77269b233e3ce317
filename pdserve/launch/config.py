"""Configuration of the launcher (``pdserve serve``) and of the vLLM workers it starts.

One frozen dataclass per role, validated on construction with messages that say how to fix the value. The router
has its own :class:`pdserve.router.config.RouterConfig`; the launcher only passes it flags (``router_args``). A launch
is one :class:`LauncherConfig` (flags, a YAML file, or both: flags win), which the launcher turns into one
:class:`WorkerConfig` per vLLM server (see :func:`pdserve.launch.plan_workers`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..settings import (
    DTYPES,
    ConfigError,
    check_fields,
    check_slo_needs_conductor,
    default,
    of,
    setting,
    write_resolved,
)
from ..settings.connector import ConnectorConfig
from ..settings.lora import check_max_lora_rank, parse_lora_modules
from ..settings.secret import SECRET_ENV
from ..settings.speculative import parse_speculative_config
from .config_devices import (
    check_gpus_and_data_plane,
    check_tp,
    check_worker_gpu,
    check_worker_tp,
    cpu_list_text,
    gpu_ids,
    parse_cpu_list,
    tensor_parallel,
)
from .config_experts import check_experts
from .config_services import check_pool, check_supervision

__all__ = ["DTYPES", "ROLES", "ConfigError", "LauncherConfig", "WorkerConfig", "default_model_dir",
           "parse_cpu_list"]

ROLES = ("prefill", "decode", "colocated", "elastic")
CONNECTOR_NAME = "PdserveConnector"
CONNECTOR_MODULE = "pdserve.vllm.connector"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_ARG_FIELDS = ("worker_args", "prefill_args", "decode_args", "router_args")
NIXL_CONNECTOR_NAME = "NixlConnector"


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_model_dir() -> Path:
    """Where the converted SmolLM2-135M-Instruct folder lives (converted on first use).

    ``$PDSERVE_MODELS_DIR/smollm2-135m-instruct`` if that variable is set; else ``<repo>/models/...`` when
    running from a checkout (the folder is gitignored); else ``~/.cache/pdserve/models/...``.
    """
    env = os.environ.get("PDSERVE_MODELS_DIR")
    if env:
        return Path(env).expanduser() / DEFAULT_MODEL_NAME
    root = _repo_root()
    if (root / "pyproject.toml").is_file():
        return root / "models" / DEFAULT_MODEL_NAME
    return Path.home() / ".cache" / "pdserve" / "models" / DEFAULT_MODEL_NAME


_LAUNCHER = of("launcher")


def _d(name: str) -> Any:  # the table's default
    return default(name)


def _check_str_tuple(name: str, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{name} must be a list of strings (command-line words), got {value!r}")


def _check_env(name: str, value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"{name} must map variable names to string values, got {value!r}")


@dataclass(frozen=True)
class WorkerConfig:
    """One vLLM OpenAI server started by the launcher.

    role: ``prefill`` / ``decode`` (disaggregated; both load the pdserve connector as ``kv_both``, the role is
    only the pool the router puts the worker in) or ``colocated`` (serves whole requests).
    cores: CPU ids the worker's OpenMP compute threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``).
    connector: load :class:`pdserve.vllm.connector.PdserveConnector` (``--kv-transfer-config``).
    connector_extra: extra ``kv_connector_extra_config`` entries (the transfer secret travels in the environment
    variable ``PDSERVE_TRANSFER_SECRET``, never on the command line, where ``ps`` would show it).
    """

    role: str
    index: int
    model: str
    port: int = 0
    host: str = "127.0.0.1"
    cores: tuple[int, ...] = ()
    kv_cache_gib: int = _d("kv_cache_gib")
    max_model_len: int = _d("max_model_len")
    max_num_batched_tokens: int | None = _d("max_num_batched_tokens")
    stream_interval: int = _d("stream_interval")
    dtype: str | None = _d("dtype")
    served_model_name: str | None = _d("served_model_name")
    speculative_config: str = ""  # vLLM's --speculative-config JSON ("" none); the launcher sets it per role
    expert_parallel: bool = False  # vLLM's --enable-expert-parallel
    dp: int = 1  # vLLM's --data-parallel-size (data-parallel attention ranks; GPU workers)
    # LoRA (--enable-lora, --lora-modules, --max-lora-rank, --max-loras; VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    enable_lora: bool = _d("enable_lora")
    lora_modules: str = _d("lora_modules")
    max_lora_rank: int = _d("max_lora_rank")
    max_loras: int = _d("max_loras")
    connector: bool = True
    lease_s: float = _d("lease_s")
    connector_extra: Mapping[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # KV events (policy conductor): where vLLM binds its publisher and its replay socket (ipc://PATH or
    # tcp://*:PORT; every router replica subscribes), topic = url; "" none
    kv_events_endpoint: str = ""
    kv_events_replay: str = ""
    # GPU workers and vLLM's NixlConnector: gpus -> CUDA_VISIBLE_DEVICES (empty: a CPU worker);
    # gpu_memory_utilization -> --gpu-memory-utilization (None: vLLM's default); kv_connector: the data plane
    # the connector flag loads ("pdserve" or "nixl"); tensor parallelism is ``tp`` below (one GPU per rank);
    # nixl_side_channel_port: VLLM_NIXL_SIDE_CHANNEL_PORT, where NixlConnector's handshake listener binds;
    # mooncake_bootstrap_port: VLLM_MOONCAKE_BOOTSTRAP_PORT, where MooncakeConnector's bootstrap server binds
    # (mooncake_protocol: its transfer engine's protocol).
    gpus: tuple[str, ...] = ()
    gpu_memory_utilization: float | None = _d("gpu_memory_utilization")
    kv_connector: str = _d("kv_connector")
    nixl_side_channel_port: int = 0
    mooncake_bootstrap_port: int = 0
    mooncake_protocol: str = _d("mooncake_protocol")
    # pool_backend mooncake: the Mooncake Store config file (MOONCAKE_CONFIG_PATH) of vLLM's MooncakeStoreConnector,
    # which the worker then loads next to its P -> D connector through vLLM's MultiConnector ("": no store)
    mooncake_store_config: str = ""
    # tensor parallelism: vLLM's --tensor-parallel-size; on CPU each rank gets len(cores) / tp of the cores
    tp: int = 1
    otlp_traces_endpoint: str = _d("otlp_traces_endpoint")  # vLLM's --otlp-traces-endpoint ("": no tracing)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"worker role {self.role!r} unknown; choose one of {ROLES}")
        if not isinstance(self.index, int) or self.index < 0:
            raise ConfigError(f"worker index {self.index!r} must be an integer >= 0")
        if not self.model:
            raise ConfigError("worker model is empty: pass the model folder (--model DIR)")
        for s in _WORKER:  # the table's checks of what a worker gets, named decode0.kv_cache_gib, ...
            s.check(getattr(self, s.name), f"{self.name}.{s.name}")
        setting("port").check(self.port, f"{self.name}.port")
        for name in ("kv_events_endpoint", "kv_events_replay"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"{self.name}.{name}={value!r}: use ipc://PATH or tcp://*:PORT (vLLM binds it)")
        if not self.cores or not all(isinstance(c, int) and c >= 0 for c in self.cores):
            raise ConfigError(f"{self.name}.cores={self.cores!r}: give at least one CPU id >= 0")
        _check_common(self, self.name + ".")
        check_worker_gpu(self)
        check_worker_tp(self)

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def omp_bind(self) -> str:
        """The ``VLLM_CPU_OMP_THREADS_BIND`` value for :attr:`cores`: ``"0"``, ``"0-1"``, ``"0,2"``."""
        cores = sorted(set(self.cores))
        if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
            return f"{cores[0]}-{cores[-1]}"
        return ",".join(str(c) for c in cores)

    @property
    def rank_cores(self) -> tuple[tuple[int, ...], ...]:
        """The cores of each tensor-parallel rank: :attr:`cores` cut into ``tp`` equal consecutive groups."""
        per = len(self.cores) // self.tp
        return tuple(tuple(self.cores[r * per:(r + 1) * per]) for r in range(self.tp))

    @property
    def omp_bind_ranks(self) -> str:
        """``VLLM_CPU_OMP_THREADS_BIND`` with one core list per rank, separated by ``|`` (``"0|1"``)."""
        if self.tp == 1:
            return self.omp_bind
        return "|".join(cpu_list_text(c) for c in self.rank_cores)


_WORKER = tuple(s for s in of("worker") if s.name in {f.name for f in fields(WorkerConfig)})


def _check_common(cfg: Any, prefix: str = "") -> None:
    """Checks shared by the launcher and worker configs (same field names) beyond the table's."""
    parse_lora_modules(cfg.lora_modules, cfg.served_model_name or "")
    check_max_lora_rank(cfg.max_lora_rank)
    parse_speculative_config(cfg.speculative_config)
    if not isinstance(cfg.connector_extra, Mapping):
        raise ConfigError(f"{prefix}connector_extra must be a mapping, got {cfg.connector_extra!r}")
    if "secret" in cfg.connector_extra:
        raise ConfigError(
            f"{prefix}connector_extra must not carry 'secret': the launcher generates a fresh transfer secret "
            f"per launch and passes it in ${SECRET_ENV} (command lines are visible to every user via ps)"
        )
    if hasattr(cfg, "extra_args"):
        _check_str_tuple(f"{prefix}extra_args", cfg.extra_args)
    _check_env(f"{prefix}env", cfg.env)


@dataclass(frozen=True)
class LauncherConfig:
    """Everything ``pdserve serve`` needs; build with :meth:`from_mapping` / :meth:`from_yaml` or directly.

    Mode: ``colocated > 0`` starts that many plain workers behind the router (the baseline); otherwise
    ``prefill`` and ``decode`` workers (default 1 each) with the pdserve connector.
    model: a Hugging Face style folder; empty means SmolLM2-135M-Instruct, converted on first use into
    :func:`default_model_dir`.
    port: the router's public port (0 picks a free one); workers always get free ports on ``worker_host``.
    cores: CPU ids to spread workers over (empty: every CPU this process may run on); each worker gets
    ``cores_per_worker`` consecutive ids from that list, round-robin, so with more workers than cores some
    share a core.
    worker_args / prefill_args / decode_args: extra vLLM flags for every worker / only prefill / only decode
    workers (e.g. ``["--max-num-seqs", "64"]``); router_args: extra ``python -m pdserve.router`` flags.
    env: extra environment variables for every worker.
    run_dir: folder for logs and ``launch.json`` (default ``.pdserve/runs/<timestamp>-<pid>``).
    policy: the router's placement policy: ``round_robin`` (default), ``least_loaded`` or ``conductor``
    (prefix-, load- and SLO-aware; workers then publish KV cache events to the router).
    ttft_slo_ms / tpot_slo_ms: conductor targets; requests predicted to miss them get 429 + Retry-After.
    recalibration_window: placements whose measured error corrects the conductor's predictions (0: off).
    tier_pricing: how the conductor prices a prefill's start: priced, flat (as before tiers) or device.
    pool: start a KV pool (``pdserve store`` master + one node) and point every worker's connector at it
    (default: on whenever the connector is); pool_mem / pool_disk: host memory / SSD bytes the node lends
    (e.g. ``1GiB``; pool_disk 0 = no SSD tier); pool_disk_dir: the SSD tier's folder (default: ``pool-ssd``
    in the run folder, removed at stop); pool_port: the master's port (0 = a free one).
    restart: the launcher restarts any process that exits once the launch is up (pdserve/launch/supervisor.py):
    after restart_backoff_s, doubled per exit in a row up to restart_backoff_max_s; the streak resets after
    restart_reset_s healthy; crash_loop_restarts restarts within crash_loop_window_s and the next exit gives
    that process up. metrics_port: the launcher's own /metrics (restart counts) on ``host`` (0 = a free one).
    start_indexer: start ``pdserve indexer`` (policy conductor): every router replica seeds from it and shares its
    placements through it as placeholders.
    """

    model: str = _d("model")
    prefill: int | None = _d("prefill")
    decode: int | None = _d("decode")
    colocated: int = _d("colocated")
    host: str = _d("host")
    port: int = _d("port")
    routers: int = _d("routers")  # router processes on the public port (SO_REUSEPORT), all supervised
    worker_host: str = _d("worker_host")
    cores: tuple[int, ...] = ()
    cores_per_worker: int = _d("cores_per_worker")
    kv_cache_gib: int = _d("kv_cache_gib")
    max_model_len: int = _d("max_model_len")
    max_num_batched_tokens: int | None = _d("max_num_batched_tokens")
    stream_interval: int = _d("stream_interval")
    dtype: str | None = _d("dtype")
    served_model_name: str | None = _d("served_model_name")
    speculative_config: str = _d("speculative_config")  # vLLM's JSON; settings/speculative.py: which roles get it
    enable_lora: bool = _d("enable_lora")  # on whenever lora_modules names an adapter
    lora_modules: str = _d("lora_modules")
    max_lora_rank: int = _d("max_lora_rank")
    max_loras: int = _d("max_loras")
    connector: bool | None = _d("connector")
    lease_s: float = _d("lease_s")
    kv_checksum: bool = _d("kv_checksum")
    layerwise_kv: bool = _d("layerwise_kv")  # an early hand-off's KV moves layer by layer (pdserve's connector)
    early_dispatch: bool = _d("early_dispatch")  # the router sends D its request while P prefills (pdserve's connector)
    early_continue: str = _d("early_continue")  # ... D continues after P's t1 or regenerates it
    connector_extra: Mapping[str, Any] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    run_dir: str = _d("run_dir")
    worker_timeout_s: float = _d("worker_timeout_s")
    router_timeout_s: float = _d("router_timeout_s")
    stop_timeout_s: float = _d("stop_timeout_s")
    policy: str = _d("policy")
    ttft_slo_ms: float | None = _d("ttft_slo_ms")
    tpot_slo_ms: float | None = _d("tpot_slo_ms")
    recalibration_window: int = _d("recalibration_window")
    tier_pricing: str = _d("tier_pricing")
    pool: bool | None = _d("pool")
    pool_mem: str = _d("pool_mem")
    pool_disk: str = _d("pool_disk")
    pool_disk_dir: str = _d("pool_disk_dir")
    pool_port: int = _d("pool_port")
    pool_backend: str = _d("pool_backend")  # "pdserve" | "mooncake" (Mooncake Store through vLLM's MultiConnector)
    # GPU hosts and the data plane (docs/gpu.md). kv_connector: "pdserve" (pdserve's connector,
    # default), "nixl" (vLLM's NixlConnector) or "mooncake" (vLLM's MooncakeConnector, over mooncake_protocol); with
    # either of vLLM's the router speaks its hand-off and there is no KV pool. gpus: device ids for
    # CUDA_VISIBLE_DEVICES (empty: the CPU plan; `pdserve serve` fills it from discovery unless --gpus none).
    # gpus_per_worker: GPUs per worker (> 1 runs vLLM with --tensor-parallel-size, one GPU per rank).
    # share_gpu: several workers per GPU, splitting gpu_memory_utilization (default 0.9) evenly between them.
    kv_connector: str = _d("kv_connector")
    mooncake_protocol: str = _d("mooncake_protocol")
    gpus: tuple[str, ...] = ()
    gpus_per_worker: int = _d("gpus_per_worker")
    share_gpu: bool = _d("share_gpu")
    gpu_memory_utilization: float | None = _d("gpu_memory_utilization")
    # tensor parallelism per pool: vLLM ranks per prefill / decode worker; on CPU each rank gets
    # cores_per_worker cores (a worker tp x cores_per_worker); the KV pool is then off (it needs TP=1)
    prefill_tp: int = _d("prefill_tp")
    decode_tp: int = _d("decode_tp")
    # MoE at scale (config_experts.py): expert parallelism and data-parallel attention per pool
    prefill_ep: bool = _d("prefill_ep")
    decode_ep: bool = _d("decode_ep")
    prefill_dp: int = _d("prefill_dp")
    decode_dp: int = _d("decode_dp")
    # supervision (pdserve/launch/supervisor.py): restarts with backoff, crash-loop give-up, launcher /metrics
    restart: bool = _d("restart")
    restart_backoff_s: float = _d("restart_backoff_s")
    restart_backoff_max_s: float = _d("restart_backoff_max_s")
    restart_reset_s: float = _d("restart_reset_s")
    crash_loop_restarts: int = _d("crash_loop_restarts")
    crash_loop_window_s: float = _d("crash_loop_window_s")
    metrics_port: int = _d("metrics_port")
    # tracing: the OTLP collector the router and every vLLM worker send spans to ("": off), the router's sampling
    otlp_traces_endpoint: str = _d("otlp_traces_endpoint")
    otlp_traces_sample_ratio: float = _d("otlp_traces_sample_ratio")
    start_indexer: bool = _d("start_indexer")
    # elastic roles: N workers, all kv_both with pdserve's connector, none with a fixed role; the
    # router's conductor places each request colocated on one or split P -> D over two (0: off)
    elastic: int = _d("elastic")

    def __post_init__(self) -> None:
        check_fields(self, _LAUNCHER)  # every value the table declares: type, range, choices
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            check_slo_needs_conductor(getattr(self, name), name, self.policy)
        _check_mode(self)
        write_resolved(self, _resolved(self))  # the launch's derived values: counts, connector, pool, tuples
        if not self.colocated and not self.connector:
            raise ConfigError("connector=false with prefill/decode workers: the P -> D hand-off needs the connector")
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in self.cores):
            raise ConfigError(f"cores={self.cores!r}: give CPU ids (integers >= 0), e.g. [0, 1]")
        if len(set(self.cores)) != len(self.cores):
            raise ConfigError(f"cores={self.cores!r} lists a CPU twice")
        if self.cores and self.cores_per_worker > len(self.cores):
            raise ConfigError(
                f"cores_per_worker={self.cores_per_worker} but only {len(self.cores)} cores listed ({self.cores}); "
                "lower cores_per_worker or list more cores"
            )
        _check_common(self)
        check_gpus_and_data_plane(self)
        if self.connector and self.kv_connector == "pdserve":
            _check_connector_extra(self.lease_s, self.connector_extra)
            if self.connector_extra.get("transfer_port") and self.num_workers > 1:
                raise ConfigError(
                    f"connector_extra.transfer_port={self.connector_extra['transfer_port']} would be shared by "
                    f"{self.num_workers} workers on this host; leave it unset (each worker's transfer engine "
                    "then binds a free port and tells the scheduler through vLLM's handshake)"
                )
        for name in _ARG_FIELDS:
            _check_str_tuple(name, getattr(self, name))
        if self.model:
            _check_model_dir(self.model)
        check_tp(self)
        check_experts(self)
        check_pool(self)
        check_supervision(self)
        if self.start_indexer and self.policy != "conductor":
            raise ConfigError(f"start_indexer=true with policy={self.policy!r}: the indexer follows the workers' KV "
                              "events, which they publish for the conductor only; add --policy conductor, or drop "
                              "--start-indexer")

    # ------------------------------------------------------------------ derived

    @property
    def mode(self) -> str:
        return "elastic" if self.elastic else "colocated" if self.colocated else "disaggregated"

    @property
    def num_workers(self) -> int:
        return self.elastic or self.colocated or ((self.prefill or 0) + (self.decode or 0))

    @property
    def model_dir(self) -> Path:
        return Path(self.model).expanduser() if self.model else default_model_dir()

    # ------------------------------------------------------------------ loading

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config") -> LauncherConfig:
        """Build from a plain mapping (a parsed YAML file); unknown keys are errors with a suggestion."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a mapping of settings at top level, got {type(data).__name__}")
        names = cls.field_names()
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            k = str(key).replace("-", "_")
            if k not in names:
                close = difflib.get_close_matches(k, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
                raise ConfigError(f"{source}: unknown setting {key!r}{hint}")
            if k == "gpus":
                value = gpu_ids(value)
            elif k in ("cores",) + _ARG_FIELDS and isinstance(value, (list, tuple)):
                value = tuple(value)
            elif k in _ARG_FIELDS and isinstance(value, str):
                import shlex

                value = tuple(shlex.split(value))
            elif k == "cores" and isinstance(value, str):
                value = parse_cpu_list(value)
            elif k == "env" and isinstance(value, Mapping):
                value = {str(a): str(b) for a, b in value.items()}
            kwargs[k] = value
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> LauncherConfig:
        """Read a YAML file (see ``deploy/pdserve.example.yaml``); ``overrides`` (e.g. from flags) win."""
        try:
            import yaml
        except ImportError as e:  # pragma: no cover - PyYAML ships with vLLM/transformers
            raise ConfigError("reading a YAML config needs PyYAML: pip install pyyaml") from e
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {p} not found") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{p}: expected a mapping of settings at top level")
        merged = dict(data)
        merged.update(overrides)
        if "colocated" in overrides and overrides["colocated"]:
            # a --colocated flag replaces the file's prefill/decode counts instead of clashing with them
            merged.pop("prefill", None)
            merged.pop("decode", None)
        if ("prefill" in overrides or "decode" in overrides) and "colocated" not in overrides:
            merged.pop("colocated", None)
        if overrides.get("elastic"):  # a --elastic flag replaces the file's fixed roles
            for key in ("prefill", "decode", "colocated"):
                merged.pop(key, None)
        elif "prefill" in overrides or "decode" in overrides or overrides.get("colocated"):
            merged.pop("elastic", None)
        return cls.from_mapping(merged, source=str(p))

    def with_overrides(self, **overrides: Any) -> LauncherConfig:
        return replace(self, **overrides)


def _check_mode(cfg: LauncherConfig) -> None:
    """One mode: elastic (N workers alone, pdserve's connector, TP=1), colocated (K plain workers) or
    disaggregated (at least one prefill and one decode worker)."""
    if cfg.elastic:
        _check_elastic(cfg)
    elif cfg.colocated:
        if cfg.prefill or cfg.decode:
            raise ConfigError(
                f"colocated={cfg.colocated} with prefill={cfg.prefill}, decode={cfg.decode}: choose one mode "
                "(--colocated K for plain workers, or --prefill N --decode M for disaggregated serving)"
            )
    elif cfg.prefill == 0 or cfg.decode == 0:
        raise ConfigError(
            f"prefill={1 if cfg.prefill is None else cfg.prefill}, decode={1 if cfg.decode is None else cfg.decode}: "
            "disaggregated serving needs at least one of each; for plain workers use --colocated K instead"
        )


def _check_elastic(cfg: LauncherConfig) -> None:
    """elastic=N: N >= 1 workers, alone (no prefill/decode/colocated counts), with pdserve's connector, TP=1."""
    n = cfg.elastic
    if cfg.prefill or cfg.decode or cfg.colocated:
        raise ConfigError(f"elastic={n} with prefill={cfg.prefill}, decode={cfg.decode}, colocated={cfg.colocated}: "
                          "elastic workers take either role per request; give only --elastic N (or fixed roles "
                          "with --prefill N --decode M, or --colocated K)")
    if cfg.connector is False:
        raise ConfigError("connector=false with elastic workers: a request split P -> D needs pdserve's connector "
                          "in every worker; drop --no-connector")
    if cfg.kv_connector != "pdserve":
        raise ConfigError(f"kv_connector={cfg.kv_connector!r} with elastic workers: elastic roles use pdserve's "
                          "connector (kv_both in every worker); drop --kv-connector or use --prefill/--decode")
    if cfg.prefill_tp > 1 or cfg.decode_tp > 1 or cfg.prefill_args or cfg.decode_args:
        raise ConfigError("prefill_tp/decode_tp and prefill_args/decode_args apply to fixed-role workers: elastic "
                          "workers have no role; use --worker-args for flags every worker gets")


def _resolved(cfg: LauncherConfig) -> dict[str, Any]:
    """The values a launch derives from what was given (a pure function of the config as given): the worker
    counts of its mode, the connector (on unless colocated), the KV pool (on with pdserve's connector at TP=1),
    lists as tuples and GPU ids as a tuple of strings."""
    fixed = not cfg.elastic and not cfg.colocated
    out: dict[str, Any] = {
        "prefill": (1 if cfg.prefill is None else cfg.prefill) if fixed else 0,
        "decode": (1 if cfg.decode is None else cfg.decode) if fixed else 0,
        "connector": not cfg.colocated if cfg.connector is None else cfg.connector,
        "enable_lora": cfg.enable_lora or bool(cfg.lora_modules.strip()),
    }
    out["gpus"] = cfg.gpus if isinstance(cfg.gpus, tuple) else gpu_ids(cfg.gpus)
    for name in ("cores",) + _ARG_FIELDS:
        value = getattr(cfg, name)
        out[name] = tuple(value) if isinstance(value, list) else value
    if cfg.pool is None:
        tp = tensor_parallel(cfg, out["gpus"])
        own = cfg.kv_connector == "pdserve" or cfg.pool_backend == "mooncake"
        out["pool"] = bool(out["connector"]) and own and not tp
    return out


def _check_connector_extra(lease_s: float, extra: Mapping[str, Any]) -> None:
    """Let the connector's own parser judge ``kv_connector_extra_config`` now, not 30 s into a worker start."""
    try:
        ConnectorConfig.from_extra({"lease_s": lease_s, **extra}, env={SECRET_ENV: "x" * 64})
    except ConfigError as e:
        raise ConfigError(f"connector settings (lease_s / connector_extra): {e}") from None


def _check_model_dir(model: str) -> None:
    p = Path(model).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"model folder {p} does not exist: pass a Hugging Face style folder (config.json, *.safetensors, "
            "tokenizer files), or leave --model unset to use SmolLM2-135M-Instruct (converted on first use)"
        )
    if not (p / "config.json").is_file():
        raise ConfigError(f"model folder {p} has no config.json: is it a Hugging Face model folder?")
