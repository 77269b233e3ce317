"""Connector telemetry in vLLM's KV-connector stats path: :class:`PdserveStats` (one interval's counters,
worker -> vLLM's logger and ``/metrics``) and :class:`PdservePromMetrics` (the ``vllm:pdserve_kv_*``
Prometheus series)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig


_COUNTERS = ("reads", "read_failures", "read_bytes", "released_notified", "released_lease",
             "pool_loads", "pool_load_failures", "pool_loaded_tokens", "pool_load_bytes", "pool_load_seconds",
             "pool_saves", "pool_save_failures", "pool_saved_blocks", "pool_save_bytes", "pool_save_seconds",
             "checksum_failures_p2p", "checksum_failures_pool", "layerwise_reads", "layers_early",
             "layer_answer_seconds")
CHECKSUM_PATHS = {"checksum_failures_p2p": "p2p", "checksum_failures_pool": "pool"}


@dataclass
class PdserveStats(KVConnectorStats):
    """Transfer telemetry of one interval, worker -> vLLM's logger and /metrics (vllm:pdserve_*)."""

    def __post_init__(self) -> None:
        for key in _COUNTERS:
            self.data.setdefault(key, 0)
        self.data.setdefault("read_seconds", [])

    def reset(self) -> None:
        self.data: dict[str, Any] = {}
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
    """Counters vllm:pdserve_kv_{reads,read_failures,read_bytes,released_notified,released_lease,pool_*,
    layerwise_reads,layers_early,layer_answer_seconds}_total,
    vllm:pdserve_kv_checksum_failures_total{path="p2p"|"pool"} and the histogram vllm:pdserve_kv_read_seconds."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
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
                "pool_load_seconds": "seconds the KV pool's get calls took (master RPCs and the transfer)",
                "pool_saves": "finished requests whose full blocks were offered to the KV pool",
                "pool_save_failures": "KV pool saves that failed (the pool is a cache: nothing else happens)",
                "pool_saved_blocks": "KV blocks newly written to the KV pool",
                "pool_save_bytes": "KV bytes written to the KV pool",
                "pool_save_seconds": "seconds the KV pool's put calls took (master RPCs and the transfer)",
                "layerwise_reads": "early hand-offs read layer by layer as the prefill worker wrote them",
                "layers_early": "layers of those reads that landed (and were verified) before the prefill "
                                "worker's forward that computed them had ended",
                "layer_answer_seconds": "CPU seconds this prefill worker spent answering decode workers' layer-wise "
                                        "questions (checksums of each layer as it is written)"}
        self.counters = {key: per_engine(self._counter_cls(name=f"vllm:pdserve_kv_{key}", documentation=doc,
                                                           labelnames=labelnames))
                         for key, doc in docs.items()}
        checksum = self._counter_cls(
            name="vllm:pdserve_kv_checksum_failures", labelnames=[*labelnames, "path"],
            documentation="KV blocks refused before use: checksum or fingerprint mismatch (p2p: a read from a "
                          "prefill worker, recomputed; pool: a KV pool object, treated as a miss)")
        for key, path in CHECKSUM_PATHS.items():
            self.counters[key] = {idx: checksum.labels(*values, path)
                                  for idx, values in per_engine_labelvalues.items()}
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
