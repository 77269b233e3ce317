"""PdserveConnector: vLLM KV connector that hands a prompt's KV from a prefill worker (P) to a
decode worker (D) over pdserve.transfer, and loads/saves KV blocks from/to the KV pool (pdserve.store).

Load it with::

    --kv-transfer-config '{"kv_connector":"PdserveConnector","kv_connector_module_path":"pdserve.vllm.connector",
      "kv_role":"kv_both","kv_connector_extra_config":{"secret":"...","lease_s":30}}'

This module is only the facade vLLM sees. vLLM builds one connector in the scheduler process (role
SCHEDULER) and one in every worker process (role WORKER); the facade forwards each hook to that role's half:

* :mod:`pdserve.vllm.scheduler` (no vLLM import): P's lease, D's read planning, pool match/plan;
* :mod:`pdserve.vllm.worker`: KV cache registration, transfer-engine reads, pool jobs, results;
* :mod:`pdserve.vllm.release`: the one owner of P's held blocks (lease, D's notification, pool save);
* :mod:`pdserve.vllm.messages`: what the halves exchange through vLLM (registered here as vLLM's types);
* :mod:`pdserve.vllm.metrics`: PdserveStats / PdservePromMetrics (``vllm:pdserve_kv_*``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from pdserve.vllm import cpu_rewind, rng_skip
from pdserve.vllm.groups import groups_of, is_hybrid
from pdserve.vllm.logs import connector_log
from pdserve.vllm.messages import PdserveHandshake, PdserveMeta, PdserveWorkerMeta, PoolJob, RecvJob
from pdserve.vllm.metrics import PdservePromMetrics, PdserveStats
from pdserve.vllm.params import ConfigError, ConnectorConfig
from pdserve.vllm.pool_groups import pool_refusal
from pdserve.vllm.scheduler import SchedulerSide, pool_client
from pdserve.vllm.worker import WorkerSide

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

__all__ = ["PdserveConnector", "PdserveHandshake", "PdserveMeta", "PdservePromMetrics", "PdserveStats",
           "PdserveWorkerMeta", "PoolJob", "RecvJob"]

log = connector_log()

# The messages are plain dataclasses (the scheduler half builds them without vLLM); vLLM's metadata base
# classes are empty marker ABCs, so registering makes them vLLM's types without inheriting anything.
KVConnectorMetadata.register(PdserveMeta)
KVConnectorWorkerMetadata.register(PdserveWorkerMeta)
KVConnectorHandshakeMetadata.register(PdserveHandshake)


def _recompute_on_failure(vllm_config: VllmConfig, config: ConnectorConfig) -> None:
    """The contract: a failed transfer makes D recompute. vLLM reads this policy right after building the
    scheduler-side connector, so setting it here takes effect."""
    kv_config = vllm_config.kv_transfer_config
    if config.on_load_failure == "recompute" and kv_config.kv_load_failure_policy != "recompute":
        try:
            kv_config.kv_load_failure_policy = "recompute"
        except Exception:  # pragma: no cover - frozen config in some future vLLM
            log.warning("could not set kv_load_failure_policy=recompute: pass it in --kv-transfer-config")


class PdserveConnector(KVConnectorBase_V1, SupportsHMA):
    """KVConnectorBase_V1 facade: forwards to the scheduler-side or the worker-side half. ``SupportsHMA``: vLLM keeps
    its hybrid KV cache manager on (sliding-window layers keep their window, Mamba hybrids start) and hands every
    KV cache group's blocks to ``request_finished_all_groups``."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise NotImplementedError(
                "PdserveConnector supports tensor parallelism but not pipeline parallelism; "
                f"got pp={par.pipeline_parallel_size}")
        try:
            self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        except ConfigError as exc:
            raise ValueError(f"PdserveConnector: {exc}") from None
        try:  # vLLM's hybrid KV cache manager: every group's blocks move (pdserve.vllm.groups)
            groups = groups_of(kv_cache_config, vllm_config.cache_config.block_size) if kv_cache_config else ()
        except ValueError as exc:
            raise NotImplementedError(f"PdserveConnector: {exc}") from None
        refusal = pool_refusal(groups) if is_hybrid(groups) and self.config.pool_master else ""
        if refusal:
            log.warning("PdserveConnector: KV pool off on this worker: %s (KV cache groups %s); P -> D hand-offs "
                        "move every group", refusal, [g.kind for g in groups])
            self.config = replace(self.config, pool_master="")
        if par.tensor_parallel_size > 1 and self.config.pool_master:
            raise ValueError("PdserveConnector: the KV pool stores one shard per block key and supports "
                             f"tensor-parallel size 1 only (got tp={par.tensor_parallel_size}): drop "
                             "kv_connector_extra_config.pool_master (pdserve serve: --no-pool)")
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            _recompute_on_failure(vllm_config, self.config)
            self.scheduler = SchedulerSide(self.config, vllm_config.cache_config.block_size, pool_client(self.config),
                                           tp=par.tensor_parallel_size, groups=groups,
                                           prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching))
        else:
            self.worker = WorkerSide(vllm_config, self.config, kv_cache_config)
            rng_skip.install()  # seeded requests continue their random stream after a migration
            cpu_rewind.install()  # and a partial prefill's discarded draw is given back on a CPU generator

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # any layout vLLM picks: register_kv_caches derives each block's runs (pdserve.vllm.layout)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)  # type: ignore[return-value]

    def has_pending_push_work(self) -> bool:
        assert self.scheduler is not None
        return self.scheduler.has_pending_announcements()  # vLLM steps again even with nothing else to do

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished_groups(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.scheduler is not None
        self.scheduler.set_handshake(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        ids = getattr(self._kv_cache_config, "transfer_group_ids", None)
        return tuple(ids) if ids is not None else super().get_loaded_kv_cache_group_ids(request)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake() if self.worker is not None else None  # type: ignore[return-value]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, PdserveMeta) and connector_metadata.announce:
            self.worker.announce_tokens(connector_metadata.announce)  # P sampled its first token: before the forward

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._connector_metadata
        if isinstance(meta, PdserveMeta):
            self.worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # D's loads are whole requests: a request waits in WAITING_FOR_REMOTE_KVS until its last layer landed
        # (layer-wise reads included), so no forward ever runs on a layer still in flight
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, PdserveMeta):  # P: the layer is written; D may pull it
            self.worker.layer_saved(layer_name, meta)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, PdserveMeta):
            self.worker.after_forward(meta)  # seals, and early hand-offs announced, of prompts this forward completed

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
        return self.worker.take_worker_meta() if self.worker is not None else None  # type: ignore[return-value]

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdserveStats(data=dict(data)) if data is not None else PdserveStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return PdservePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
