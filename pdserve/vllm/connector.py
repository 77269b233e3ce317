"""PdserveConnector: vLLM KV connector that hands a prompt's KV from a prefill worker (P) to a
decode worker (D) over pdserve.transfer.

Load it with::

    --kv-transfer-config '{"kv_connector":"PdserveConnector","kv_connector_module_path":"pdserve.vllm.connector",
      "kv_role":"kv_both","kv_connector_extra_config":{"secret":"...","lease_s":30}}'

vLLM builds one connector in the scheduler process (role SCHEDULER) and one in every worker
process (role WORKER); they talk only through vLLM: scheduler -> worker by the per-step
:class:`PdserveMeta`, worker -> scheduler by :class:`PdserveWorkerMeta` and the finished/failed
sets, and once at start-up the worker's transfer-engine address reaches the scheduler through
vLLM's handshake-metadata hook (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``),
so the engine may bind any free port.

P (request has ``do_remote_decode``): ``request_finished`` keeps the blocks (delay_free=True),
returns where they are, and tells its worker the lease deadline. The worker releases them
(``finished_sending``) when D's READ batch notification (the P request id) arrives or the lease
runs out.

D (request has ``do_remote_prefill``): ``get_num_new_matched_tokens`` claims the prompt tokens its
prefix cache lacks as an async load; ``update_state_after_alloc`` pairs D's new blocks with P's
block ids; the worker READs them, one entry per layer per block, in one batch with
notify=remote_request_id, then reports ``finished_recving`` (or ``failed_recving`` + the block ids,
and vLLM recomputes the prompt).

KV pool (``pool_master`` set, see pdserve.store): a new request whose prompt continues beyond the local
prefix cache asks the pool master how many of the following full blocks are pooled
(``get_num_new_matched_tokens``) and loads them asynchronously into its new blocks (worker:
``StoreClient.get_into`` straight into the KV cache); a finished request's full blocks are saved to the pool
by the worker off the critical path (``StoreClient.put`` straight from the KV cache), the blocks held
(delay_free) until written. Blocks that fail to load are recomputed (vLLM's invalid-block path).
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from pdserve.hashing import block_hashes
from pdserve.store import ClientConfig, StoreClient, StoreError
from pdserve.transfer import TransferConfig, TransferEngine, TransferError
from pdserve.vllm.pool import PoolJob, SendGate, loaded_prefix, pool_items
from pdserve.vllm.params import (
    TEST_FAULTS,
    BlockPlan,
    ConfigError,
    ConnectorConfig,
    LayerGeometry,
    RemoteParams,
    SendLeases,
    build_entries,
    layout_signature,
    plan_blocks,
    prompt_hash,
)

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

try:  # vLLM >= 0.11 labels external cache hits by tier
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover
    CacheHitSource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("pdserve.vllm.connector")
if not log.handlers:  # vLLM configures its own loggers only; make ours visible in the server log
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [pdserve] %(message)s", "%m-%d %H:%M:%S"))
    log.addHandler(_h)
    log.setLevel(logging.INFO)
    log.propagate = False


# ---------------------------------------------------------------- messages between the two roles
@dataclass
class RecvJob:
    """D-side: read ``plan`` from P and report the request finished/failed receiving.

    ``load`` False: vLLM expects nothing (local prefix hit covers the prompt, or the request ended
    before it was scheduled); only notify P so it frees its blocks now. ``error``: the scheduler
    could not plan the read; the worker reports the load failed so vLLM recomputes.
    """

    req_id: str
    remote: RemoteParams
    plan: BlockPlan
    load: bool = True
    error: str = ""


@dataclass
class PdserveMeta(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    recv: list[RecvJob] = field(default_factory=list)
    send: dict[str, float] = field(default_factory=dict)  # P request id -> lease deadline (time.time())
    pool: list[PoolJob] = field(default_factory=list)  # KV pool saves and loads


@dataclass
class PdserveWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per-request READ results (for D's kv_transfer_params) and counters."""

    reads: dict[str, dict[str, Any]] = field(default_factory=dict)
    released: dict[str, str] = field(default_factory=dict)  # P request id -> "notified" | "lease"
    pool: dict[str, str] = field(default_factory=dict)  # request id -> "saved" | "loaded" | "failed" ...

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, PdserveWorkerMeta)
        merged = PdserveWorkerMeta(dict(self.reads), dict(self.released), {**self.pool, **other.pool})
        for req_id, stats in other.reads.items():  # tensor parallel: every rank reads its shard
            if req_id in merged.reads:
                mine = merged.reads[req_id]
                mine = {**mine, "bytes": mine["bytes"] + stats["bytes"], "ms": max(mine["ms"], stats["ms"]),
                        "ok": mine["ok"] and stats["ok"]}
                merged.reads[req_id] = mine
            else:
                merged.reads[req_id] = stats
        merged.released.update(other.released)
        return merged


@dataclass
class PdserveHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: the worker's transfer engine and KV layout."""

    engine_id: str
    host: str
    port: int
    layout: str


# --------------------------------------------------------------------------------- metrics
_COUNTERS = ("reads", "read_failures", "read_bytes", "released_notified", "released_lease",
             "pool_loads", "pool_load_failures", "pool_loaded_tokens", "pool_load_bytes",
             "pool_saves", "pool_save_failures", "pool_saved_blocks", "pool_save_bytes")


@dataclass
class PdserveStats(KVConnectorStats):
    """Transfer telemetry of one interval, worker -> vLLM's logger and /metrics (vllm:pdserve_*)."""

    def __post_init__(self) -> None:
        for key in _COUNTERS:
            self.data.setdefault(key, 0)
        self.data.setdefault("read_seconds", [])

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _COUNTERS:
            self.data[key] += other.data.get(key, 0)
        self.data["read_seconds"] = list(self.data["read_seconds"]) + list(other.data.get("read_seconds", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {key: self.data[key] for key in _COUNTERS}
        secs = self.data["read_seconds"]
        if secs:
            out["avg_read_ms"] = round(1e3 * sum(secs) / len(secs), 3)
            out["read_GBps"] = round(self.data["read_bytes"] / 1e9 / max(sum(secs), 1e-9), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in _COUNTERS)


class PdservePromMetrics(KVConnectorPromMetrics):
    """Counters vllm:pdserve_kv_{reads,read_failures,read_bytes,released_notified,released_lease}_total
    and the histogram vllm:pdserve_kv_read_seconds."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        docs = {"reads": "KV reads completed by this decode worker",
                "read_failures": "KV reads that failed (the prompt was recomputed)",
                "read_bytes": "KV bytes read from prefill workers",
                "released_notified": "prefill requests whose blocks were freed after the decode read them",
                "released_lease": "prefill requests whose blocks were freed when the lease ran out",
                "pool_loads": "requests that loaded a prefix from the KV pool",
                "pool_load_failures": "KV pool loads that failed in part or whole (those blocks recomputed)",
                "pool_loaded_tokens": "prompt tokens whose KV was loaded from the KV pool, not computed",
                "pool_load_bytes": "KV bytes loaded from the KV pool",
                "pool_saves": "finished requests whose full blocks were offered to the KV pool",
                "pool_save_failures": "KV pool saves that failed (the pool is a cache: nothing else happens)",
                "pool_saved_blocks": "KV blocks newly written to the KV pool",
                "pool_save_bytes": "KV bytes written to the KV pool"}
        self.counters = {key: per_engine(self._counter_cls(name=f"vllm:pdserve_kv_{key}", documentation=doc,
                                                           labelnames=labelnames))
                         for key, doc in docs.items()}
        self.read_seconds = per_engine(self._histogram_cls(
            name="vllm:pdserve_kv_read_seconds", documentation="Duration of one request's KV read",
            buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
            labelnames=labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, counter in self.counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                counter[engine_idx].inc(value)
        for secs in transfer_stats_data.get("read_seconds", []):
            self.read_seconds[engine_idx].observe(secs)


# ------------------------------------------------------------------------------- the facade
class PdserveConnector(KVConnectorBase_V1):
    """KVConnectorBase_V1 facade: forwards to the scheduler-side or the worker-side half."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size * par.pipeline_parallel_size > 1:
            raise NotImplementedError(
                "PdserveConnector supports one worker per vLLM instance (tensor/pipeline parallel size 1); "
                f"got tp={par.tensor_parallel_size} pp={par.pipeline_parallel_size}")
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) > 1:
            raise NotImplementedError(
                f"PdserveConnector handles models with one KV cache group (full attention); this model has "
                f"{len(groups)} (sliding-window or hybrid layers)")
        try:
            self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        except ConfigError as exc:
            raise ValueError(f"PdserveConnector: {exc}") from None
        self.scheduler: _Scheduler | None = None
        self.worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _Scheduler(vllm_config, self.config)
        else:
            self.worker = _Worker(vllm_config, self.config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # any layout whose blocks are contiguous; register_kv_caches checks

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.scheduler is not None
        self.scheduler.set_handshake(metadata)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        ids = getattr(self._kv_cache_config, "transfer_group_ids", None)
        return tuple(ids) if ids is not None else super().get_loaded_kv_cache_group_ids(request)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake() if self.worker is not None else None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._connector_metadata
        if isinstance(meta, PdserveMeta):
            self.worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole-request async loads: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return None  # pull model: D reads P's blocks in place, nothing to save

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        return self.worker.results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_invalid_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_worker_meta() if self.worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdserveStats(data=dict(data)) if data is not None else PdserveStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return PdservePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()


# --------------------------------------------------------------------------- scheduler side
class _Scheduler:
    def __init__(self, vllm_config: "VllmConfig", config: ConnectorConfig) -> None:
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        kv_config = vllm_config.kv_transfer_config
        self.engine_id = str(kv_config.engine_id)
        # The contract: a failed transfer makes D recompute. vLLM reads this policy right after
        # building the scheduler-side connector, so setting it here takes effect.
        if config.on_load_failure == "recompute" and kv_config.kv_load_failure_policy != "recompute":
            try:
                kv_config.kv_load_failure_policy = "recompute"
            except Exception:  # pragma: no cover - frozen config in some future vLLM
                log.warning("could not set kv_load_failure_policy=recompute: pass it in --kv-transfer-config")
        self.handshake: PdserveHandshake | None = None
        self._matched: dict[str, int] = {}  # D request -> local hit tokens seen by get_num_new_matched
        self._recv: list[RecvJob] = []
        self._send: dict[str, float] = {}
        # D request -> transfer stats for its response (bounded: aborted requests never collect theirs)
        self._reads: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.held = 0  # P requests whose blocks wait for a decode
        self.reading = 0  # D reads in flight
        self.released = {"notified": 0, "lease": 0}
        # KV pool: request -> (block-aligned local hit, pooled keys after it) seen by get_num_new_matched
        self.pool: StoreClient | None = None
        addr = config.pool_address
        if addr is not None:
            self.pool = StoreClient(ClientConfig(addr[0], addr[1], secret=config.secret,
                                                 timeout_s=config.pool_timeout_s))
            log.info("scheduler: KV pool master %s:%d (save %s, load %s)", addr[0], addr[1], config.pool_save,
                     config.pool_load)
        self._pool_hits: dict[str, tuple[int, list[int]]] = {}
        self._pool_jobs: list[PoolJob] = []
        self._pool_saving: set[str] = set()
        self._pool_down_until = 0.0
        self.pool_outcomes: dict[str, int] = {}

    # ---- KV pool ----
    def _pool_usable(self) -> bool:
        return self.pool is not None and time.monotonic() >= self._pool_down_until

    def _pool_failed(self, what: str, exc: Exception) -> None:
        self._pool_down_until = time.monotonic() + self.config.pool_backoff_s
        log.warning("KV pool %s failed (%s); not using the pool for %.0f s", what, exc, self.config.pool_backoff_s)

    def _pool_match(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the local hit whose blocks the pool holds (whole blocks, a chained prefix)."""
        self._pool_hits.pop(request.request_id, None)
        if not self.config.pool_load or not self._pool_usable() or num_computed_tokens % self.block_size:
            return 0, False
        keys = block_hashes(request.prompt_token_ids or [], self.block_size)
        first = num_computed_tokens // self.block_size
        if first >= len(keys):
            return 0, False
        try:
            n = self.pool.prefix(keys[first:])  # type: ignore[union-attr]
        except StoreError as exc:
            self._pool_failed("lookup", exc)
            return 0, False
        if n < self.config.pool_min_blocks:
            return 0, False
        self._pool_hits[request.request_id] = (num_computed_tokens, keys[first:first + n])
        return n * self.block_size, True

    def _pool_plan_load(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        hit, keys = self._pool_hits.pop(request.request_id)
        if num_external_tokens <= 0:
            return
        n = num_external_tokens // self.block_size
        first = hit // self.block_size
        local = blocks.get_block_ids()[0][first:first + n]
        self.reading += 1
        if num_external_tokens % self.block_size or len(local) != n or n > len(keys):
            log.error("request %s: cannot plan a pool load of %d tokens into %d blocks", request.request_id,
                      num_external_tokens, len(local))
            self._pool_jobs.append(PoolJob(request.request_id, (), tuple(local), False, error="plan"))
            return
        self._pool_jobs.append(PoolJob(request.request_id, tuple(keys[:n]), tuple(local), False))

    def _pool_plan_save(self, request: "Request", block_ids: list[int]) -> bool:
        """Queue a save of the request's full computed blocks; True when its blocks must stay held."""
        from vllm.v1.request import RequestStatus

        if not self.config.pool_save or not self._pool_usable():
            return False
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False  # aborted or failed: do not pool what may be partial
        tokens = list(request.all_token_ids[:request.num_computed_tokens])
        keys = block_hashes(tokens, self.block_size)
        if not keys or len(block_ids) < len(keys):
            return False
        self._pool_jobs.append(PoolJob(request.request_id, tuple(keys), tuple(block_ids[:len(keys)]), True))
        self._pool_saving.add(request.request_id)
        return True

    def set_handshake(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        rank0 = metadata.get(0) or next(iter(metadata.values()), None)
        if not isinstance(rank0, PdserveHandshake):
            raise ValueError(f"PdserveConnector expected PdserveHandshake from the workers, got {rank0!r}")
        self.handshake = rank0
        log.info("scheduler: transfer engine %s at %s:%d, KV layout %s", rank0.engine_id, rank0.host,
                 rank0.port, rank0.layout)

    # ---- D ----
    def _remote(self, request: "Request") -> RemoteParams | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return RemoteParams.parse(params, self.block_size)
        except ValueError as exc:
            log.warning("request %s: ignoring kv_transfer_params (%s); it will be computed locally",
                        request.request_id, exc)
            params["do_remote_prefill"] = False
            return None

    def _loadable_tokens(self, request: "Request", remote: RemoteParams) -> int:
        """Prompt tokens D may take from P: 0 when the prefix or the layout differs or the lease is
        (nearly) over."""
        n = min(remote.num_tokens, request.num_prompt_tokens)
        if remote.prompt_hash and remote.prompt_hash != prompt_hash(request.prompt_token_ids or [], n):
            log.warning("request %s: prompt differs from the one P prefilled; computing locally",
                        request.request_id)
            return 0
        if self.handshake and remote.layout and remote.layout != self.handshake.layout:
            log.warning("request %s: P's KV layout %s differs from ours %s (same model, dtype and block "
                        "size on both?); computing locally", request.request_id, remote.layout,
                        self.handshake.layout)
            return 0
        if remote.lease_deadline and time.time() > remote.lease_deadline - self.config.clock_margin_s:
            log.warning("request %s: P's lease on the blocks has run out; computing locally", request.request_id)
            return 0
        return n

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            return self._pool_match(request, num_computed_tokens) if self.pool is not None else (0, False)
        count = self._loadable_tokens(request, remote) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            if request.request_id in self._pool_hits:
                self._pool_plan_load(request, blocks, num_external_tokens)
            return
        remote = self._remote(request)
        params["do_remote_prefill"] = False  # one transfer per request, even if rescheduled
        if remote is None:
            return
        hit = self._matched.pop(request.request_id, None)
        if remote.test_fault and remote.test_fault not in TEST_FAULTS:
            log.warning("unknown pdserve_test_fault %r ignored", remote.test_fault)
        if num_external_tokens <= 0:
            self._recv.append(RecvJob(request.request_id, remote, BlockPlan((), ()), load=False))
            return
        try:
            local_ids = blocks.get_block_ids()[0]
            if hit is None:  # count D's prefix-cache hits: leading blocks that already have a hash
                hit = 0
                for block in blocks.blocks[0]:
                    if block.block_hash is None:
                        break
                    hit += self.block_size
            plan = plan_blocks(local_ids, hit, num_external_tokens, remote.block_ids, self.block_size)
            self._recv.append(RecvJob(request.request_id, remote, plan))
        except Exception as exc:  # never strand a request in WAITING_FOR_REMOTE_KVS
            log.exception("request %s: cannot plan the KV read", request.request_id)
            self._recv.append(RecvJob(request.request_id, remote, BlockPlan((), ()), error=repr(exc)))

    # ---- P ----
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pool_hits.pop(request.request_id, None)
        delay, out = self._request_finished(request, block_ids)
        if self.pool is not None and self._pool_plan_save(request, block_ids):
            delay = True  # the worker reports finished_sending once the save (and any decode read) is done
        return delay, out

    def _request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._matched.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Never scheduled (e.g. aborted while queued): tell P to free its blocks now.
            remote = self._remote(request)
            params["do_remote_prefill"] = False
            if remote is not None:
                self._recv.append(RecvJob(request.request_id, remote, BlockPlan((), ()), load=False))
            return False, None
        reads = self._reads.pop(request.request_id, None)
        if not params.get("do_remote_decode"):
            return False, ({"pdserve": reads} if reads else None)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or errored prefill: nothing to hand off, free now
        if self.handshake is None:
            log.error("request %s asked for remote decode but no worker published its transfer engine; "
                      "freeing its blocks", request.request_id)
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        nblocks = -(-num_tokens // self.block_size)
        if num_tokens <= 0 or len(block_ids) < nblocks:
            return False, None
        lease_s = self.config.lease_s
        if params.get("lease_s") is not None:  # per-request override (router/tests), bounded
            try:
                lease_s = min(max(float(params["lease_s"]), 0.1), 3600.0)
            except (TypeError, ValueError):
                pass
        deadline = time.time() + lease_s
        self._send[request.request_id] = deadline
        self.held += 1
        hs = self.handshake
        remote = RemoteParams(hs.engine_id, hs.host, hs.port, tuple(block_ids[:nblocks]), num_tokens,
                              request.request_id, hs.layout,
                              prompt_hash(request.prompt_token_ids or [], num_tokens), deadline)
        return True, remote.to_params()

    # ---- per step ----
    def build_connector_meta(self, scheduler_output: "SchedulerOutput | None" = None) -> PdserveMeta:
        if (scheduler_output is not None and not scheduler_output.total_num_scheduled_tokens
                and not self._recv and not self._send and not self._pool_jobs
                and (self.held > 0 or self._pool_saving) and self.reading == 0
                and self.config.idle_wait_ms > 0):
            # vLLM keeps stepping while P holds blocks for a decode, even with nothing to run: an
            # empty-step loop that busy-spins the engine, worker and API processes (~1.5 cores here)
            # for up to a lease. Pace those steps; a request arriving meanwhile waits at most this.
            time.sleep(self.config.idle_wait_ms / 1e3)
        self.reading += sum(1 for job in self._recv if job.load)
        meta = PdserveMeta(self._recv, self._send, self._pool_jobs)
        self._recv, self._send, self._pool_jobs = [], {}, []
        return meta

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, PdserveWorkerMeta):
            self._reads.update(meta.reads)
            while len(self._reads) > 10000:
                self._reads.popitem(last=False)
            loads_done = sum(1 for v in meta.pool.values() if v.startswith("load"))
            self.reading = max(0, self.reading - len(meta.reads) - loads_done)
            for req_id, outcome in meta.pool.items():
                if outcome.startswith("save"):
                    self._pool_saving.discard(req_id)
                self.pool_outcomes[outcome] = self.pool_outcomes.get(outcome, 0) + 1
            for reason in meta.released.values():
                self.held -= 1
                self.released[reason] = self.released.get(reason, 0) + 1


# ------------------------------------------------------------------------------ worker side
def _span_view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 array over raw memory we keep alive elsewhere (the KV cache tensor)."""
    return np.frombuffer((ctypes.c_ubyte * nbytes).from_address(addr), dtype=np.uint8)


class _Worker:
    def __init__(self, vllm_config: "VllmConfig", config: ConnectorConfig) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        rank = 0
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            rank = get_tensor_model_parallel_rank()
        except Exception:
            pass
        self.rank = rank
        tconf = TransferConfig(secret=config.secret, host=config.transfer_host,
                               advertise_host=config.advertise_host, port=config.port_for_rank(rank),
                               backend=config.backend, streams=config.streams,
                               default_deadline_s=config.transfer_deadline_s)
        self.engine = TransferEngine(tconf)
        self.layers: list[LayerGeometry] = []
        self.layout = ""
        self._tensors: dict[str, torch.Tensor] = {}
        self._peers: dict[tuple[str, int], Any] = {}
        self._leases = SendLeases(early_ttl_s=max(600.0, 4 * config.lease_s))
        self._notes: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.engine.on_notify(self._on_notify)
        self._lock = threading.Lock()
        self._inflight: dict[str, RecvJob] = {}
        self._done: list[tuple[RecvJob, bool, dict[str, Any]]] = []
        self._invalid: set[int] = set()
        self._meta = PdserveWorkerMeta()
        self.stats = PdserveStats()  # since the last get_kv_connector_stats
        self.pool: StoreClient | None = None
        if config.pool_address is not None:
            host, port = config.pool_address
            self.pool = StoreClient(ClientConfig(host, port, secret=config.secret,
                                                 timeout_s=max(config.pool_timeout_s, 2.0),
                                                 transfer_deadline_s=min(config.transfer_deadline_s, 4.0)),
                                    self.engine)
        self._gate = SendGate()
        self._pool_done: list[tuple[PoolJob, int, dict[str, Any]]] = []  # (job, blocks that made it, stats)
        seg = self.engine.segment()
        log.info("worker rank %d: transfer engine %s listening on %s:%d (backend %s)", rank,
                 self.engine.engine_id, seg.host, seg.port, config.backend)

    # ---- start-up ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: dict[int, str] = {}
        dtype = ""
        for name in sorted(kv_caches):
            t = kv_caches[name]
            if t.device.type != "cpu":
                raise RuntimeError(f"PdserveConnector: layer {name} KV cache is on {t.device}; this build "
                                   "moves CPU KV caches only")
            if t.data_ptr() in seen:  # cross-layer KV sharing: transfer the owner once
                continue
            seen[t.data_ptr()] = name
            # [num_kernel_blocks, ...] with each kernel block's interior contiguous (CPU: [B, H, N, 2*D]).
            elem = t.element_size()
            if t.dim() < 2 or not t[0].is_contiguous():
                raise RuntimeError(f"PdserveConnector: layer {name} KV cache {tuple(t.shape)} strides "
                                   f"{t.stride()} has non-contiguous blocks; unsupported KV layout")
            kernel_blocks = t.shape[0]
            kernel_bytes = t[0].numel() * elem
            kernel_stride = t.stride(0) * elem
            kernel_block_size = t.shape[2] if t.dim() == 4 else self.block_size
            ratio = max(1, self.block_size // kernel_block_size)
            if ratio > 1 and kernel_stride != kernel_bytes:
                raise RuntimeError(f"PdserveConnector: layer {name}: a {self.block_size}-token block spans "
                                   f"{ratio} non-adjacent kernel blocks; unsupported KV layout")
            span = (kernel_blocks - 1) * kernel_stride + kernel_bytes
            self.engine.register(name, _span_view(t.data_ptr(), span))
            self._tensors[name] = t  # keep alive; zeroing in tests
            self.layers.append(LayerGeometry(name, kernel_stride * ratio, kernel_bytes * ratio))
            dtype = str(t.dtype).replace("torch.", "")
        self.layout = layout_signature(dtype, self.layers, self.block_size)
        first = kv_caches[self.layers[0].name] if self.layers else None
        log.info("worker: registered %d KV layers (%s), per-layer cache %s strides %s, %d B per block, "
                 "layout %s", len(self.layers), dtype, tuple(first.shape) if first is not None else None,
                 first.stride() if first is not None else None,
                 self.layers[0].block_bytes if self.layers else 0, self.layout)

    def handshake(self) -> PdserveHandshake:
        seg = self.engine.segment()
        return PdserveHandshake(self.engine.engine_id, seg.host, seg.port, self.layout)

    # ---- per step ----
    def start(self, meta: PdserveMeta) -> None:
        for req_id, deadline in meta.send.items():
            self._leases.add(req_id, deadline)
        for pjob in meta.pool:
            if pjob.save:
                self._gate.start_save(pjob.req_id)
            threading.Thread(target=self._pool_run, args=(pjob,), name=f"pdserve-pool-{pjob.req_id[:24]}",
                             daemon=True).start()
        for job in meta.recv:
            if job.load:
                with self._lock:
                    self._inflight[job.req_id] = job
            threading.Thread(target=self._run, args=(job,), name=f"pdserve-read-{job.req_id[:24]}",
                             daemon=True).start()

    def _peer(self, remote: RemoteParams) -> Any:
        key = (remote.host, remote.port)
        seg = self._peers.get(key)
        if seg is None or seg.engine_id != remote.engine_id:
            seg = self.engine.fetch_segment(remote.host, remote.port)
            if seg.engine_id != remote.engine_id:
                raise TransferError("peer", f"{remote.host}:{remote.port} is engine {seg.engine_id}, not "
                                            f"{remote.engine_id} (P restarted?)")
            self._peers[key] = seg
        return seg

    def _run(self, job: RecvJob) -> None:
        remote, plan = job.remote, job.plan
        t0 = time.perf_counter()
        stats: dict[str, Any] = {"bytes": 0, "ms": 0.0, "blocks": len(plan), "ok": False}
        ok = False
        if not job.load:  # nothing to read: only release P's blocks
            try:
                self.engine.submit(self._peer(remote), [], "read", notify=remote.request_id,
                                   deadline_s=self.config.transfer_deadline_s).result()
                log.info("request %s: released P's blocks of %s without reading (local prefix hit or "
                         "abort)", job.req_id, remote.request_id)
            except Exception as exc:
                log.warning("request %s: could not tell P to free %s (%s); its lease will", job.req_id,
                            remote.request_id, exc)
            return
        try:
            if job.error:
                raise TransferError("plan", job.error)
            peer = self._peer(remote)
            if remote.layout and remote.layout != self.layout:
                raise TransferError("layout", f"P's KV layout {remote.layout} != ours {self.layout}")
            deadline_s = self.config.transfer_deadline_s
            if remote.lease_deadline:
                deadline_s = min(deadline_s, remote.lease_deadline - self.config.clock_margin_s - time.time())
                if deadline_s <= 0:
                    raise TransferError("deadline", "P's lease on the blocks ran out before the read began")
            if remote.test_fault == "fail" and self.config.allow_test_faults:
                raise TransferError("test", "pdserve_test_fault=fail")
            entries = build_entries(self.layers, plan)
            handle = self.engine.submit(peer, entries, "read", notify=remote.request_id, deadline_s=deadline_s)
            handle.result()
            stats["bytes"] = handle.total_bytes
            if remote.test_fault == "zero" and self.config.allow_test_faults:
                self._zero_blocks(plan.local)
                log.warning("request %s: pdserve_test_fault=zero: zeroed %d received blocks", job.req_id,
                            len(plan))
            ok = True
        except Exception as exc:  # every failure ends in a recompute, never in partial KV
            stats["error"] = f"{type(exc).__name__}: {exc}"
            log.warning("request %s: KV read from %s:%s failed (%s); vLLM will recompute the prompt",
                        job.req_id, remote.host, remote.port, stats["error"])
            self._release_remote(remote)
        finally:
            stats["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            stats["ok"] = ok
            with self._lock:
                self._done.append((job, ok, stats))
        if ok:
            log.info("request %s: read %d blocks (%d B) from %s in %.2f ms (%.2f GB/s)", job.req_id, len(plan),
                     stats["bytes"], remote.request_id, stats["ms"], stats["bytes"] / 1e6 / max(stats["ms"], 1e-6))

    def _pool_run(self, job: PoolJob) -> None:
        """Save the job's blocks to the pool, or load them from it, straight between KV cache and nodes."""
        t0 = time.perf_counter()
        block_bytes = sum(g.block_bytes for g in self.layers)
        stats: dict[str, Any] = {"blocks": len(job.keys), "bytes": 0}
        good = 0
        try:
            if self.pool is None or job.error:
                raise StoreError("plan", job.error or "no pool configured on this worker")
            items = pool_items(self.layers, job.keys, job.block_ids)
            if job.save:
                statuses = self.pool.put(items)
                stored = statuses.count("stored")
                good = stored + statuses.count("exists")
                stats.update(stored=stored, bytes=stored * block_bytes,
                             full=statuses.count("full"), failed=statuses.count("failed"))
            else:
                good = loaded_prefix(self.pool.get_into(items))
                stats["bytes"] = good * block_bytes
        except Exception as exc:  # the pool is a cache: a failure costs a recompute, never a wrong token
            stats["error"] = f"{type(exc).__name__}: {exc}"
            log.warning("request %s: KV pool %s failed: %s", job.req_id, "save" if job.save else "load",
                        stats["error"])
        stats["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        with self._lock:
            self._pool_done.append((job, good, stats))
        if not job.save and good:
            log.info("request %s: loaded %d of %d blocks (%d B) from the KV pool in %.2f ms", job.req_id, good,
                     len(job.block_ids), stats["bytes"], stats["ms"])

    def _pool_results(self, recving: set[str], failed: set[str]) -> set[str]:
        """Account finished pool jobs; return the request ids whose saves ended."""
        saves_done: set[str] = set()
        with self._lock:
            done, self._pool_done = self._pool_done, []
        for job, good, stats in done:
            data = self.stats.data
            if job.save:
                saves_done.add(job.req_id)
                ok = "error" not in stats
                self._meta.pool[job.req_id] = "saved" if ok else "save_failed"
                data["pool_saves"] += 1
                data["pool_save_failures"] += 0 if ok else 1
                data["pool_saved_blocks"] += stats.get("stored", 0)
                data["pool_save_bytes"] += stats["bytes"]
                continue
            recving.add(job.req_id)
            data["pool_loads"] += 1
            data["pool_loaded_tokens"] += good * self.block_size
            data["pool_load_bytes"] += stats["bytes"]
            if good < len(job.block_ids):  # the rest is recomputed: vLLM keeps the valid prefix
                failed.add(job.req_id)
                self._invalid.update(job.block_ids[good:])
                data["pool_load_failures"] += 1
                self._meta.pool[job.req_id] = "load_partial" if good else "load_failed"
            else:
                self._meta.pool[job.req_id] = "loaded"
        return saves_done

    def _release_remote(self, remote: RemoteParams) -> None:
        """Best effort: tell P to free the blocks now rather than at the lease's end."""
        try:
            peer = self._peer(remote)
            self.engine.submit(peer, [], "read", notify=remote.request_id, deadline_s=2.0)
        except Exception:
            pass

    def _zero_blocks(self, block_ids: tuple[int, ...]) -> None:
        for layer in self.layers:
            base = self._tensors[layer.name].data_ptr()
            for b in block_ids:
                ctypes.memset(base + b * layer.block_stride, 0, layer.block_bytes)

    def _on_notify(self, note: Any) -> None:
        msg = note.message
        self._notes.put(msg.decode() if isinstance(msg, bytes) else str(msg))

    def results(self) -> KVConnectorTransferResults:
        while True:
            try:
                self._leases.notify(self._notes.get_nowait())
            except queue.Empty:
                break
        notified, expired = self._leases.collect()
        for req_id in expired:
            log.warning("P request %s: no decode read its KV blocks within the lease; freeing them", req_id)
        for req_id in notified:
            log.info("P request %s: decode read its KV blocks; freeing them", req_id)
        self._meta.released.update({r: "notified" for r in notified})
        self._meta.released.update({r: "lease" for r in expired})
        self.stats.data["released_notified"] += len(notified)
        self.stats.data["released_lease"] += len(expired)
        recving: set[str] = set()
        failed: set[str] = set()
        saves_done = self._pool_results(recving, failed)
        sending = self._gate.release(notified | expired, saves_done, lambda r: r in self._leases.leases)
        with self._lock:
            done, self._done = self._done, []
            for job, ok, stats in done:
                self._inflight.pop(job.req_id, None)
                recving.add(job.req_id)
                self._meta.reads[job.req_id] = stats
                if ok:
                    self.stats.data["reads"] += 1
                    self.stats.data["read_bytes"] += stats["bytes"]
                    self.stats.data["read_seconds"].append(stats["ms"] / 1e3)
                else:
                    failed.add(job.req_id)
                    self._invalid.update(job.plan.local)
                    self.stats.data["read_failures"] += 1
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def take_stats(self) -> PdserveStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, PdserveStats()
        return out

    def take_invalid_blocks(self) -> set[int]:
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    def take_worker_meta(self) -> PdserveWorkerMeta | None:
        meta = self._meta
        if not meta.reads and not meta.released and not meta.pool:
            return None
        self._meta = PdserveWorkerMeta()
        return meta

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        try:
            self.engine.close()
        except Exception:
            pass
