"""Reads a vLLM worker's /metrics into the numbers the conductor's load view uses.

vLLM v1 exports ``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``
(0..1) and ``vllm:cache_config_info{block_size=..., num_gpu_blocks=...}`` (KV capacity), plus prefix-cache
counters. Only what is present is used. :class:`LoadFollower` reads every worker's into the conductor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from ...conductor import Conductor
from ...prom import label_values, parse
from .registry import WorkerRegistry


@dataclass
class WorkerReport:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    kv_capacity_tokens: int = 0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0


def parse_vllm_metrics(text: str) -> WorkerReport:
    sums = parse(text, "vllm:")
    r = WorkerReport()
    for key in parse(text, "vllm:cache_config_info", labels=True):
        lab = label_values(key)
        try:
            r.kv_capacity_tokens = int(float(lab.get("num_gpu_blocks", 0))) * int(float(lab.get("block_size", 0)))
        except ValueError:
            pass
    r.waiting = int(sums.get("vllm:num_requests_waiting", 0))
    r.running = int(sums.get("vllm:num_requests_running", 0))
    r.kv_usage = sums.get("vllm:kv_cache_usage_perc", sums.get("vllm:gpu_cache_usage_perc", 0.0))
    r.prefix_cache_queries = sums.get("vllm:prefix_cache_queries_total", 0.0)
    r.prefix_cache_hits = sums.get("vllm:prefix_cache_hits_total", 0.0)
    return r


async def read_worker_load(session: aiohttp.ClientSession, url: str, timeout_s: float) -> WorkerReport | None:
    """The worker's load, or None when it does not answer in time."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return parse_vllm_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


class LoadFollower:
    """Reads every worker's /metrics (queue, running, KV usage and capacity) into the conductor every
    ``interval_s`` until cancelled."""

    def __init__(self, registry: WorkerRegistry, conductor: Conductor,
                 session: Callable[[], aiohttp.ClientSession | None], timeout_s: float, interval_s: float) -> None:
        self.registry = registry
        self.conductor = conductor
        self.session = session
        self.timeout_s = timeout_s
        self.interval_s = interval_s

    async def run(self) -> None:
        session = self.session()
        assert session is not None, "router not started"
        while True:
            workers = list(self.registry)
            reports = await asyncio.gather(*(read_worker_load(session, w.url, self.timeout_s) for w in workers))
            for w, r in zip(workers, reports):
                if r is not None:
                    self.conductor.report_load(w.url, r.waiting, r.running, r.kv_usage, r.kv_capacity_tokens)
            self.conductor.expire_reports()
            await asyncio.sleep(self.interval_s)
