"""Configuration of the launcher (``pdserve serve``) and of the vLLM workers it starts.

One frozen dataclass per role, validated on construction with messages that say how to fix the value.
The router has its own :class:`pdserve.router.config.RouterConfig`; the launcher only passes it command-line
flags (``router_args``), so the two never drift apart.

A launch is described by one :class:`LauncherConfig` (from flags, a YAML file, or both: flags win); the
launcher turns it into one :class:`WorkerConfig` per vLLM server (see :func:`pdserve.launcher.plan_workers`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .config_devices import (
    check_gpus_and_data_plane,
    check_tp,
    check_worker_gpu,
    check_worker_tp,
    cpu_list_text,
    gpu_ids,
    parse_cpu_list,
)
from .config_fields import ConfigError, check_port
from .config_services import check_pool, check_supervision
from .rules import check_policy, check_slo, check_slo_needs_conductor

ROLES = ("prefill", "decode", "colocated", "elastic")
DTYPES = ("auto", "bfloat16", "float", "float32", "half", "float16")
CONNECTOR_NAME = "PdserveConnector"
CONNECTOR_MODULE = "pdserve.vllm.connector"
SECRET_ENV = "PDSERVE_TRANSFER_SECRET"  # same name as pdserve.transfer.config.SECRET_ENV
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
    kv_cache_gib: int = 1
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None
    dtype: str | None = None
    served_model_name: str | None = None
    connector: bool = True
    lease_s: float = 30.0
    connector_extra: Mapping[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    kv_events_endpoint: str = ""  # the router's KV event sink (tcp://HOST:PORT): vLLM publishes there, topic = url
    # GPU workers and vLLM's NixlConnector (issue 13): gpus -> CUDA_VISIBLE_DEVICES (empty: a CPU worker);
    # gpu_memory_utilization -> --gpu-memory-utilization (None: vLLM's default); kv_connector: the data plane
    # the connector flag loads ("pdserve" or "nixl"); tensor parallelism is ``tp`` below (one GPU per rank);
    # nixl_side_channel_port: VLLM_NIXL_SIDE_CHANNEL_PORT, where NixlConnector's handshake listener binds.
    gpus: tuple[str, ...] = ()
    gpu_memory_utilization: float | None = None
    kv_connector: str = "pdserve"
    nixl_side_channel_port: int = 0
    # tensor parallelism: vLLM's --tensor-parallel-size; on CPU each rank gets len(cores) / tp of the cores
    tp: int = 1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"worker role {self.role!r} unknown; choose one of {ROLES}")
        if not isinstance(self.index, int) or self.index < 0:
            raise ConfigError(f"worker index {self.index!r} must be an integer >= 0")
        if not self.model:
            raise ConfigError("worker model is empty: pass the model folder (--model DIR)")
        check_port(f"{self.name}.port", self.port)
        if self.kv_events_endpoint and not self.kv_events_endpoint.startswith("tcp://"):
            raise ConfigError(f"{self.name}.kv_events_endpoint={self.kv_events_endpoint!r}: use tcp://HOST:PORT")
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


def _check_common(cfg: Any, prefix: str = "") -> None:
    """Checks shared by the launcher and worker configs (same field names)."""
    if not isinstance(cfg.kv_cache_gib, int) or isinstance(cfg.kv_cache_gib, bool) or cfg.kv_cache_gib < 1:
        raise ConfigError(
            f"{prefix}kv_cache_gib={cfg.kv_cache_gib!r}: vLLM's CPU KV cache is sized in whole GiB "
            "(VLLM_CPU_KVCACHE_SPACE); use an integer >= 1"
        )
    if not isinstance(cfg.max_model_len, int) or cfg.max_model_len < 16:
        raise ConfigError(f"{prefix}max_model_len={cfg.max_model_len!r}: use an integer >= 16 (tokens)")
    mnbt = cfg.max_num_batched_tokens
    if mnbt is not None and (not isinstance(mnbt, int) or mnbt < 1):
        raise ConfigError(f"{prefix}max_num_batched_tokens={mnbt!r}: use a positive integer, or leave it unset")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ConfigError(
            f"{prefix}dtype={cfg.dtype!r} unknown; choose one of {DTYPES} "
            "(this CPU has no fast fp16: prefer bfloat16 or float32)"
        )
    if not isinstance(cfg.lease_s, (int, float)) or cfg.lease_s <= 0:
        raise ConfigError(f"{prefix}lease_s={cfg.lease_s!r}: seconds a prefill worker keeps KV for decode; use > 0")
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
    pool: start a KV pool (``pdserve store`` master + one node) and point every worker's connector at it
    (default: on whenever the connector is); pool_mem / pool_disk: host memory / SSD bytes the node lends
    (e.g. ``1GiB``; pool_disk 0 = no SSD tier); pool_disk_dir: the SSD tier's folder (default: ``pool-ssd``
    in the run folder, removed at stop); pool_port: the master's port (0 = a free one).
    restart: the launcher restarts any process that exits once the launch is up (pdserve/launch/supervisor.py):
    after restart_backoff_s, doubled per exit in a row up to restart_backoff_max_s; the streak resets after
    restart_reset_s healthy; crash_loop_restarts restarts within crash_loop_window_s and the next exit gives
    that process up. metrics_port: the launcher's own /metrics (restart counts) on ``host`` (0 = a free one).
    """

    model: str = ""
    prefill: int | None = None
    decode: int | None = None
    colocated: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    worker_host: str = "127.0.0.1"
    cores: tuple[int, ...] = ()
    cores_per_worker: int = 1
    kv_cache_gib: int = 1
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None
    dtype: str | None = None
    served_model_name: str | None = None
    connector: bool | None = None
    lease_s: float = 30.0
    connector_extra: Mapping[str, Any] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    run_dir: str = ""
    worker_timeout_s: float = 600.0
    router_timeout_s: float = 120.0
    stop_timeout_s: float = 20.0
    policy: str = "round_robin"
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    pool: bool | None = None
    pool_mem: str = "1GiB"
    pool_disk: str = "0"
    pool_disk_dir: str = ""
    pool_port: int = 0
    # GPU hosts and the data plane (issue 13; see docs/gpu.md). kv_connector: "pdserve" (pdserve's connector,
    # default) or "nixl" (vLLM's NixlConnector; the router speaks its hand-off, no KV pool). gpus: device ids for
    # CUDA_VISIBLE_DEVICES (empty: the CPU plan; `pdserve serve` fills it from discovery unless --gpus none).
    # gpus_per_worker: GPUs per worker (> 1 runs vLLM with --tensor-parallel-size, one GPU per rank).
    # share_gpu: several workers per GPU, splitting gpu_memory_utilization (default 0.9) evenly between them.
    kv_connector: str = "pdserve"
    gpus: tuple[str, ...] = ()
    gpus_per_worker: int = 1
    share_gpu: bool = False
    gpu_memory_utilization: float | None = None
    # tensor parallelism per pool: vLLM ranks per prefill / decode worker; on CPU each rank gets
    # cores_per_worker cores (a worker tp x cores_per_worker); the KV pool is then off (it needs TP=1)
    prefill_tp: int = 1
    decode_tp: int = 1
    # supervision (pdserve/launch/supervisor.py): restarts with backoff, crash-loop give-up, launcher /metrics
    restart: bool = True
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    restart_reset_s: float = 300.0
    crash_loop_restarts: int = 5
    crash_loop_window_s: float = 600.0
    metrics_port: int = 0
    # elastic roles (issue 16): N workers, all kv_both with pdserve's connector, none with a fixed role; the
    # router's conductor places each request colocated on one or split P -> D over two (0: off)
    elastic: int = 0

    def __post_init__(self) -> None:
        check_policy(self.policy, "policy", ConfigError)
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            check_slo(getattr(self, name), name, "ms", ConfigError)
            check_slo_needs_conductor(getattr(self, name), name, self.policy, ConfigError)
        for name in ("prefill", "decode", "colocated"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"{name}={v!r}: use a whole number of workers >= 0")
        if self.elastic:
            _check_elastic(self)
        elif self.colocated:
            if self.prefill or self.decode:
                raise ConfigError(
                    f"colocated={self.colocated} with prefill={self.prefill}, decode={self.decode}: choose one mode "
                    "(--colocated K for plain workers, or --prefill N --decode M for disaggregated serving)"
                )
            object.__setattr__(self, "prefill", 0)
            object.__setattr__(self, "decode", 0)
        else:
            object.__setattr__(self, "prefill", 1 if self.prefill is None else self.prefill)
            object.__setattr__(self, "decode", 1 if self.decode is None else self.decode)
            if not self.prefill or not self.decode or self.prefill < 1 or self.decode < 1:
                raise ConfigError(
                    f"prefill={self.prefill}, decode={self.decode}: disaggregated serving needs at least one of each; "
                    "for plain workers use --colocated K instead"
                )
        if self.connector is None:
            object.__setattr__(self, "connector", not self.colocated)
        elif not self.colocated and not self.connector:
            raise ConfigError("connector=false with prefill/decode workers: the P -> D hand-off needs the connector")
        for name in ("cores",) + _ARG_FIELDS:
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
        check_port("port", self.port)
        for name in ("host", "worker_host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{name} must be an address such as 127.0.0.1")
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in self.cores):
            raise ConfigError(f"cores={self.cores!r}: give CPU ids (integers >= 0), e.g. [0, 1]")
        if len(set(self.cores)) != len(self.cores):
            raise ConfigError(f"cores={self.cores!r} lists a CPU twice")
        if not isinstance(self.cores_per_worker, int) or self.cores_per_worker < 1:
            raise ConfigError(f"cores_per_worker={self.cores_per_worker!r}: use an integer >= 1")
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
        for name in ("worker_timeout_s", "router_timeout_s", "stop_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"{name}={v!r}: use a positive number of seconds")
        check_tp(self)
        check_pool(self)
        check_supervision(self)

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


def _check_elastic(cfg: LauncherConfig) -> None:
    """elastic=N: N >= 1 workers, alone (no prefill/decode/colocated counts), with pdserve's connector, TP=1."""
    n = cfg.elastic
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"elastic={n!r}: use a whole number of workers >= 1 (0 turns elastic roles off)")
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
    object.__setattr__(cfg, "prefill", 0)
    object.__setattr__(cfg, "decode", 0)


def _check_connector_extra(lease_s: float, extra: Mapping[str, Any]) -> None:
    """Let the connector's own parser judge ``kv_connector_extra_config`` now, not 30 s into a worker start."""
    try:
        from pdserve.vllm.params import ConfigError as ConnectorConfigError
        from pdserve.vllm.params import ConnectorConfig
    except ImportError:  # pragma: no cover - the connector package ships with pdserve
        return
    try:
        ConnectorConfig.from_extra({"lease_s": lease_s, **extra}, env={SECRET_ENV: "x" * 64})
    except ConnectorConfigError as e:
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
