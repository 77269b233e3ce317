"""What the conductor learns of the workers' KV caches besides placement: the KV event feed (each worker's
publisher, followed while the worker is registered) and the KV pool's contents (pdserve's pool master, or
Mooncake Store's key listing). Conductor placement only; round-robin needs neither."""

from __future__ import annotations

import logging

import aiohttp

from ..config import RouterConfig, check_kv_publisher
from ..workers.client import Worker
from .index_seed import seed_from_indexer
from .kv_events import KVEventFeed, Publisher, default_publisher
from .mooncake_store import MooncakeStoreFollower
from .placeholders import ExpectingIndex, PlaceholderSync
from .placement import ConductorPlacement
from .pool_index import PoolIndexFollower
from .registry import WorkerRegistry

log = logging.getLogger("pdserve.router")


class KVFeeds:
    """The event feed and the pool follower: built by :meth:`start`, closed by :meth:`close`; a registry listener,
    so the feed follows each worker's publisher while the worker is registered."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        # each worker's KV event publisher (--kv-events, or given when it joins through the membership API)
        self.publishers: dict[str, Publisher] = {}
        for entry in config.kv_events:
            url, endpoint, replay = check_kv_publisher(entry)
            self.publishers[url] = Publisher(endpoint, replay)
        self.events: KVEventFeed | None = None
        self.pool: PoolIndexFollower | MooncakeStoreFollower | None = None
        self.placeholders: PlaceholderSync | None = None  # with --indexer: placements shared as placeholders

    # ---- RegistryListener ----
    def worker_added(self, worker: Worker) -> None:
        publisher = self.publishers.get(worker.url) or default_publisher(worker.url, self.config.kv_events_port)
        if self.events is not None and publisher is not None:
            self.events.follow(worker.url, publisher)

    def health_changed(self, worker: Worker) -> None:
        pass

    def worker_removed(self, url: str) -> None:
        if self.events is not None:
            self.events.forget(url)

    # ---- lifecycle ----
    async def start(self, cp: ConductorPlacement, registry: WorkerRegistry,
                    session: aiohttp.ClientSession | None) -> None:
        """Open the feed, seed it from the KV indexer (``--indexer``), follow every registered worker, and start
        following the pool's contents."""
        c = self.config
        index = ExpectingIndex(cp.conductor) if c.indexer and session is not None else None
        self.events = KVEventFeed(index or cp.conductor, c.block_size, c.kv_events_bind)
        if self.events.endpoint:
            log.info("KV event sink on %s", self.events.endpoint)
        if c.indexer and session is not None and index is not None:
            # before following: the seeded workers resume from the indexer's batch
            await seed_from_indexer(session, c.indexer, self.events, index,
                                    {w.url: self.publishers[w.url] for w in registry if w.url in self.publishers})
            if c.policy == "conductor":  # placements as placeholders, every replica's
                self.placeholders = PlaceholderSync(c.indexer, session, index)
                cp.on_placed.append(self.placeholders.placed)
                self.placeholders.start()
        for w in registry:
            self.worker_added(w)
        if c.pool_master and c.policy == "conductor":
            self.pool = PoolIndexFollower(c.pool_master, c.pool_secret, cp.conductor)
        elif c.mooncake_store and c.policy == "conductor":
            store = MooncakeStoreFollower(c.mooncake_store, c.model_dir, cp.conductor)
            self.events.learners.append(store.learn)  # the store's keys are vLLM's hashes: the events map them
            self.pool = store

    def batches(self) -> dict:
        """The feed's batch counts per worker (the conductor collector's gauges)."""
        return self.events.batches if self.events is not None else {}

    async def close(self) -> None:
        if self.placeholders is not None:
            await self.placeholders.close()
        if self.events is not None:
            await self.events.close()
        if self.pool is not None:
            await self.pool.close()
