"""Router settings: one frozen dataclass, validated on construction with messages that say how to fix a value."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..settings import ConfigError, check_fields, default, of, write_resolved
from ..settings.lora import parse_lora_modules
from ..settings.rules import check_host_port

ELASTIC_ROLES = ("prefill", "decode", "elastic")  # a worker with no fixed role: it can prefill and decode, per request

# config.json keys that bound the context length, in the order vLLM consults them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "model_max_length")
_SETTINGS = of("router")


def _d(name: str) -> Any:  # the table's default for the router
    return default(name, "router")


class RouterConfigError(ConfigError):
    """A router setting is wrong; the message says which and how to fix it."""


def check_url(flag: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RouterConfigError(f"{flag} {url!r}: give a worker's base URL like http://127.0.0.1:8100 "
                                "(scheme and host, no /v1 path)")
    if parts.path.rstrip("/") not in ("",):
        raise RouterConfigError(f"{flag} {url!r}: give the base URL without a path (the router adds /v1/...)")
    return url.rstrip("/")


def check_endpoint(flag: str, endpoint: str) -> str:
    """A ZMQ endpoint the router connects to (``tcp://HOST:PORT`` or ``ipc://PATH``)."""
    if not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) <= len("ipc://"):
        raise RouterConfigError(f"{flag} {endpoint!r}: give a ZMQ endpoint such as tcp://10.0.0.5:5557 or "
                                "ipc:///run/pdserve/kv-0.pub")
    return endpoint


def check_kv_publisher(entry: str) -> tuple[str, str, str]:
    """``URL=ENDPOINT[,REPLAY]`` (``--kv-events``): a worker, where its vLLM publishes KV events, and where it
    answers replay requests ("" none) -> (url, endpoint, replay)."""
    url, sep, rest = entry.partition("=")
    if not sep:
        raise RouterConfigError(f"--kv-events {entry!r}: give URL=ENDPOINT[,REPLAY_ENDPOINT], e.g. "
                                "http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558")
    endpoint, _, replay = rest.partition(",")
    return (check_url("--kv-events", url), check_endpoint("--kv-events", endpoint),
            check_endpoint("--kv-events", replay) if replay else "")


def context_length_from_model_dir(model_dir: str) -> int | None:
    """The model's maximum context from ``config.json`` (None when no key says it)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for source in (cfg, cfg.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8": 1, "fp8": 1}


def kv_bytes_per_token(model_dir: str) -> int:
    """KV cache bytes per token of a standard (MHA/GQA) model from its config.json: 2 (K and V) x layers x KV
    heads x head dim x dtype bytes; 0 when config.json does not say (the conductor then ignores transfer cost)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    cfg = cfg.get("text_config") or cfg
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg.get("num_attention_heads") or 0)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or (int(cfg["hidden_size"]) // heads))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


@dataclass(frozen=True)
class RouterConfig:
    """Settings of one router process.

    Disaggregated mode: ``prefill`` and ``decode`` list the workers' base URLs (one may appear in both when it
    runs the connector with ``kv_role: kv_both``). Colocated mode (baseline): ``colocated`` lists workers that
    serve whole requests; then ``prefill``/``decode`` must be empty.
    model_dir: Hugging Face folder with the tokenizer (and chat template) and config.json; read locally only.
    served_model_name: the name clients use in ``model``; defaults to ``model_dir`` as given (as vLLM does).
    max_model_len: context limit the router enforces (prompt + max_tokens); defaults to config.json's
    ``max_position_embeddings``. Set it to the workers' ``--max-model-len``.
    upstream_idle_timeout_s: a worker that sends nothing for this long fails the request (no hung streams).
    health_interval_s: period of the background health probes (0 turns them off; /health always probes).
    policy: placement: ``round_robin`` | ``least_loaded`` | ``conductor`` (see :mod:`pdserve.conductor`).
    kv_events: ``URL=ENDPOINT[,REPLAY]`` per worker: where its vLLM binds its KV event publisher (and replay
        endpoint); the router subscribes to each, so every router replica hears every worker
        (:mod:`pdserve.router.fleet.kv_events`).
    kv_events_bind: the older layout, one router only: a ZMQ endpoint the router binds for the workers' KV events
        (e.g. tcp://127.0.0.1:5557); workers publish to it with their own URL as the topic.
        Neither: no prefix index (load-only placement).
    ttft_slo_ms / tpot_slo_ms: conductor targets (429 + Retry-After when predicted to miss); None: no target.
    local_prefill_tokens: conductor: decode-local at most this many uncached prompt tokens (None: learned).
    recalibration_window: conductor: placements whose measured error corrects the predictions (0: off).
    tier_pricing: conductor: priced (each tier at its bandwidth), flat (as before tiers) or device (device hits
        only); docs/conductor.md, "Tiers".
    block_size: the workers' KV block size in tokens (vLLM CPU: 128); block keys must match it.
    calibrate: conductor: time a few prefills and decodes per worker at start-up to seed the cost model.
    load_interval_s: how often the conductor reads workers' /metrics (queue, running, KV usage).
    admin_token: bearer token required by the worker-membership endpoints (/v1/pdserve/workers); empty: they
        accept only clients on this host (loopback). Also read from $PDSERVE_ADMIN_TOKEN.
    max_body_bytes: largest request body accepted (413 above it, before parsing); default 4 MiB.
    kv_connector: the workers' KV data plane, whose hand-off the router speaks (:mod:`pdserve.router.run.kv_protocol`):
        ``pdserve`` (default: pdserve's connector), ``nixl`` (vLLM's NixlConnector) or ``mooncake`` (vLLM's
        MooncakeConnector; ``mooncake_bootstrap_port`` / ``mooncake_bootstrap`` say where each P's bootstrap
        server listens).
    migration_limit: how many times one request may move to another worker after its worker failed with it in
        flight (prompt + tokens so far go to the new worker); past it the client gets an error event.
    request_timeout_s: every request's deadline, arrival to last token (504, or an error event after the first
        token); its worker streams are closed, so vLLM frees their KV.
    handoff_timeout_s: P's answer -> D's first token; past it the request fails with 504 / an error event.
    max_inflight: requests in flight in the router, all workers together (429 + Retry-After above; None: none).
    max_inflight_per_worker: requests placed on one worker; every policy skips full workers, 429 when all are.
    elastic: workers with no fixed role (pdserve's connector as ``kv_both``); the conductor places each request
        colocated on one of them or split P -> D over two (:mod:`pdserve.conductor.elastic`); disaggregated mode
        for the router (it detokenizes), alone (not with ``prefill``/``decode``/``colocated``).
    max_num_batched_tokens: the workers' per-step token budget (their vLLM ``--max-num-batched-tokens``), for
        the conductor's ``chunk_tokens`` (elastic placement models a prefill chunked into a decoding worker with
        it; the app building the ConductorConfig must pass it on). None: unknown (a prefill is one step).
    moves: elastic placement moves a worker's running decodes to other workers when it starts a prefill that would
        stall them for longer than a move costs (:mod:`pdserve.conductor.moves`, :mod:`pdserve.router.fleet.move`).
    probe_failures / probe_window_s: a worker whose health probes time out or break is taken out only after this
        many failures in a row spanning at least this long (refused connections and non-200 answers at once).
    """

    model_dir: str
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    host: str = _d("host")
    port: int = _d("port")
    routers: int = _d("routers")  # router replicas on this port (SO_REUSEPORT above 1)
    membership_file: str = _d("membership_file")  # run-time membership shared with the other replicas
    served_model_name: str = _d("served_model_name")
    max_model_len: int = _d("max_model_len")
    connect_timeout_s: float = _d("connect_timeout_s")
    upstream_idle_timeout_s: float = _d("upstream_idle_timeout_s")
    health_timeout_s: float = _d("health_timeout_s")
    health_interval_s: float = _d("health_interval_s")
    log_level: str = _d("log_level")
    policy: str = _d("policy")
    kv_events_bind: str = _d("kv_events_bind")
    kv_events_port: int = _d("kv_events_port")  # a worker's publisher at tcp://<its host>:PORT when none is named
    ttft_slo_ms: float | None = _d("ttft_slo_ms")
    tpot_slo_ms: float | None = _d("tpot_slo_ms")
    local_prefill_tokens: int | None = _d("local_prefill_tokens")
    recalibration_window: int = _d("recalibration_window")
    tier_pricing: str = _d("tier_pricing")
    block_size: int = _d("block_size")
    calibrate: bool = _d("calibrate")
    load_interval_s: float = _d("load_interval_s")
    admin_token: str = ""
    mode_hint: str = _d("mode_hint")  # "colocated" | "disaggregated" | "elastic": start with no workers (they join)
    pool_master: str = _d("pool_master")  # HOST:PORT of the KV pool master: the conductor learns pooled prefixes
    pool_secret: str = ""  # its shared secret ($PDSERVE_TRANSFER_SECRET)
    indexer: str = _d("indexer")  # URL of a pdserve indexer to seed the prefix index from (docs/indexer.md)
    mooncake_store: str = _d("mooncake_store")  # HOST:PORT of Mooncake Store's admin: pooled prefixes, same way
    max_body_bytes: int = _d("max_body_bytes")
    kv_connector: str = _d("kv_connector")
    mooncake_bootstrap_port: int = _d("mooncake_bootstrap_port")  # kv_connector mooncake: P's bootstrap server port
    mooncake_bootstrap: str = _d("mooncake_bootstrap")  # URL=PORT,...: per-worker bootstrap ports (shared hosts)
    otlp_traces_endpoint: str = _d("otlp_traces_endpoint")  # OTLP collector ("": tracing off; router/tracing/)
    otlp_traces_sample_ratio: float = _d("otlp_traces_sample_ratio")  # share of requests traced
    migration_limit: int = _d("migration_limit")
    request_timeout_s: float = _d("request_timeout_s")
    handoff_timeout_s: float = _d("handoff_timeout_s")
    max_inflight: int | None = _d("max_inflight")
    max_inflight_per_worker: int | None = _d("max_inflight_per_worker")
    probe_failures: int = _d("probe_failures")
    probe_window_s: float = _d("probe_window_s")
    tool_call_parser: str = _d("tool_call_parser")  # vLLM's --tool-call-parser name (e.g. hermes)
    kv_events: tuple[str, ...] = ()  # URL=ENDPOINT[,REPLAY]: each worker's KV event publisher (the router subscribes)
    elastic: tuple[str, ...] = ()  # workers with no fixed role (kv_both): each request colocated or split
    max_num_batched_tokens: int | None = _d("max_num_batched_tokens")  # the workers' per-step token budget
    early_dispatch: bool = _d("early_dispatch")  # pdserve's connector: D is sent its request while P prefills
    early_continue: str = _d("early_continue")  # ... D continues after P's t1 or regenerates it
    moves: bool = _d("moves")  # elastic: move running decodes off a worker that starts a long prefill when it pays
    lora_modules: str = _d("lora_modules")  # NAME=PATH,...: the adapters every worker loads (model=NAME)
    enable_lora: bool = _d("enable_lora")  # the workers serve adapters: /v1/(un)load_lora_adapter reach them
    prefiller_header: bool = _d("prefiller_header")  # a gateway's decode sidecar (router/fleet/sidecar.py)

    def __post_init__(self) -> None:
        self._check_model_dir()
        write_resolved(self, self._resolved())
        check_fields(self, _SETTINGS, RouterConfigError, flags=True)
        self._check_sidecar()
        self._check_mode()
        for entry in self.kv_events:
            check_kv_publisher(entry)
        if self.kv_events_bind and not self.kv_events_bind.startswith(("tcp://", "ipc://")):
            raise RouterConfigError(f"--kv-events-bind {self.kv_events_bind!r}: give an endpoint to bind such as "
                                    "tcp://127.0.0.1:5557")
        try:
            parse_bootstrap_ports(self.mooncake_bootstrap)
        except ValueError as e:
            raise RouterConfigError(f"--mooncake-bootstrap {e}") from None
        check_host_port(self.pool_master, "--pool-master", "HOST:PORT of the KV pool master", RouterConfigError, " ")
        check_host_port(self.mooncake_store, "--mooncake-store", "HOST:PORT of the Mooncake Store master's HTTP "
                        "admin server", RouterConfigError, " ")
        if self.indexer and not self.indexer.startswith(("http://", "https://")):
            raise RouterConfigError(f"--indexer {self.indexer!r}: give the indexer's URL, such as "
                                    "http://127.0.0.1:8100")
        if self.pool_master and not self.pool_secret:
            raise RouterConfigError("--pool-master needs the pool's shared secret in $PDSERVE_TRANSFER_SECRET")
        try:
            parse_lora_modules(self.lora_modules, self.served_model_name)
        except ConfigError as e:
            raise RouterConfigError(f"--lora-modules: {e}") from None
        if self.tool_call_parser and not self.tool_call_parser.replace("_", "").replace("-", "").isalnum():
            raise RouterConfigError(f"--tool-call-parser {self.tool_call_parser!r}: give one of vLLM's parser names "
                                    "(e.g. hermes, llama3_json, mistral), as for `vllm serve --tool-call-parser`")

    def _resolved(self) -> dict[str, object]:
        """Worker URLs as tuples without a trailing slash; the served name (default: ``model_dir``); the context
        limit (0: config.json's)."""
        out: dict[str, object] = {}
        for name in ("prefill", "decode", "colocated", "elastic"):
            value = getattr(self, name)
            out[name] = tuple(check_url(f"--{name}", u) for u in ((value,) if isinstance(value, str) else value))
        out["served_model_name"] = self.served_model_name or self.model_dir
        out["enable_lora"] = self.enable_lora or bool(self.lora_modules.strip())
        if self.max_model_len == 0:
            found = context_length_from_model_dir(self.model_dir)
            if found is None:
                raise RouterConfigError(f"{self.model_dir}/config.json gives no context length "
                                        "(max_position_embeddings): pass --max-model-len (the workers' value)")
            out["max_model_len"] = found
        return out

    def _check_model_dir(self) -> None:
        if not self.model_dir:
            raise RouterConfigError("--model-dir is required: the model folder whose tokenizer and chat template "
                                    "the router uses (the same folder the workers serve)")
        model_dir = Path(self.model_dir)
        if not model_dir.is_dir():
            raise RouterConfigError(f"--model-dir {self.model_dir!r} is not a directory: point it at the Hugging "
                                    "Face model folder the workers serve")
        if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                        "tokenizer.model", "vocab.json")):
            raise RouterConfigError(f"--model-dir {self.model_dir!r} has no tokenizer files (tokenizer.json, "
                                    "tokenizer_config.json): the router tokenizes prompts with them")

    def _check_sidecar(self) -> None:
        if not self.prefiller_header:
            return
        if len(self.decode) != 1 or self.colocated or self.elastic or self.mode_hint in ("colocated", "elastic"):
            raise RouterConfigError("--prefiller-header runs the router as one decode worker's sidecar: give exactly "
                                    "one --decode URL (the local decode worker, e.g. http://127.0.0.1:8000) and the "
                                    "prefill pool as --prefill URL... (or --mode disaggregated to let prefill "
                                    "workers join through POST /v1/pdserve/workers)")

    def _check_mode(self) -> None:
        if self.colocated and (self.prefill or self.decode):
            raise RouterConfigError("--colocated cannot be combined with --prefill/--decode: choose colocated "
                                    "(baseline) or disaggregated mode")
        if self.elastic and (self.prefill or self.decode or self.colocated or self.mode_hint == "colocated"):
            raise RouterConfigError("--elastic cannot be combined with --prefill/--decode/--colocated: an elastic "
                                    "pool's workers take either role per request; list every worker under "
                                    "--elastic")
        mode = self.mode_hint  # one of the table's choices (checked above)
        if mode == "elastic" and (self.prefill or self.decode or self.colocated):
            raise RouterConfigError("--mode elastic contradicts --prefill/--decode/--colocated: an elastic router's "
                                    "workers have no fixed role (list them under --elastic, or let them join with "
                                    "role elastic)")
        if mode in ("colocated", "disaggregated") and (
                self.colocated if mode == "disaggregated" else (self.prefill or self.decode)):
            raise RouterConfigError(f"--mode {mode} contradicts the worker flags given")
        if not mode and not self.colocated and not (self.prefill and self.decode) and not self.elastic and not (
                self.prefiller_header and self.decode):
            raise RouterConfigError("give at least one --prefill and one --decode worker URL (disaggregated), or "
                                    "--colocated URL... (baseline), or --elastic URL... (no fixed roles), or "
                                    "--mode to start empty and let workers "
                                    "join through POST /v1/pdserve/workers")

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated or self.mode_hint == "colocated" else "disaggregated"

    @property
    def is_elastic(self) -> bool:
        """Workers have no fixed role (``--elastic URL...``, or ``--mode elastic`` to start empty); ``mode`` is
        then ``disaggregated`` (the router detokenizes, as for a P -> D hand-off)."""
        return bool(self.elastic) or self.mode_hint == "elastic"

    def all_workers(self) -> list[tuple[str, str]]:
        """(role, url) for every configured worker, a URL listed once per role."""
        if self.colocated:
            return [("colocated", u) for u in self.colocated]
        if self.elastic:  # able to prefill and decode (so /ready and the role metrics see both), marked elastic
            return [(role, u) for u in self.elastic for role in ELASTIC_ROLES]
        return [("prefill", u) for u in self.prefill] + [("decode", u) for u in self.decode]


def parse_bootstrap_ports(text: str) -> dict[str, int]:
    """``URL=PORT,URL=PORT`` (``--mooncake-bootstrap``) -> {url without trailing slash: port}; "" -> {}.
    Raises ValueError naming the bad entry."""
    out: dict[str, int] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        url, sep, port = entry.rpartition("=")
        if not sep or not url.startswith(("http://", "https://")) or not urlsplit(url).hostname:
            raise ValueError(f"{entry!r}: give WORKER_URL=PORT, e.g. http://127.0.0.1:8001=8998")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{entry!r}: the port must be 1-65535")
        out[url.rstrip("/")] = int(port)
    return out
