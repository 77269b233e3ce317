"""The indexer service: one owner for the table, the workers' KV event streams, the pool's event log and the
snapshots (start, register, unregister, snapshot, close).

It runs on its own (``pdserve indexer``: a process, or a pod in the chart) and is shared by every router replica
and picker; the router's in-process index (``--policy conductor`` without an indexer) is the same feed and
translators applied to the conductor's own index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..conductor.tiers import POOL, holder_of
from ..kube.discovery import PoolTarget
from ..kube.dns_follow import follow_dns
from ..router.fleet.kv_events import KVEventFeed, Publisher, Replayer
from ..router.fleet.kv_replay import replay
from ..router.fleet.pool_index import DISK_HOLDER, PoolIndexFollower
from . import snapshot
from .discovery import FeedMembership
from .expect_log import ExpectLog
from .table import TieredIndex
from .xxh3_keys import Xxh3Keys

log = logging.getLogger("pdserve.indexer")


@dataclass
class IndexerConfig:
    block_size: int = 128
    snapshot_path: str = ""  # "" : no snapshots
    snapshot_interval_s: float = 10.0
    placeholder_ttl_s: float = 10.0
    pool_master: str = ""
    pool_secret: str = ""
    workers: list[tuple[str, Publisher]] = field(default_factory=list)  # (worker URL = its topic, publisher)
    dns: tuple[PoolTarget, ...] = ()  # pools whose ready pods are followed (.discovery), at kv_events_port
    kv_events_port: int = 0
    discovery_interval_s: float = 5.0
    xxh3: bool = False  # also map blocks to Mooncake's XXH3 sequence hashes (.xxh3_keys)
    xxh3_seed: int = 0
    xxh3_max_blocks: int = 2_000_000


@dataclass
class SnapshotStats:
    blocks: int = 0  # (holder, block) entries in the last snapshot
    bytes: int = 0
    capture_s: float = 0.0
    write_s: float = 0.0
    taken: int = 0
    restored_blocks: int = 0
    restore_s: float = 0.0


class IndexerService:
    def __init__(self, config: IndexerConfig, clock: Callable[[], float] = time.monotonic,
                 replayer: Replayer = replay) -> None:
        self.config = config
        self.replayer = replayer
        self.table = TieredIndex(clock, config.placeholder_ttl_s)
        self.expects = ExpectLog(config.placeholder_ttl_s, clock)  # the placeholders posted, for the routers
        self.feed: KVEventFeed | None = None
        self.pool: PoolIndexFollower | None = None
        self.xxh3 = Xxh3Keys(config.block_size, config.xxh3_seed, config.xxh3_max_blocks) if config.xxh3 else None
        self.stats = SnapshotStats()
        self._task: asyncio.Task[None] | None = None
        self._dns_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Restore the last snapshot (when there is one), resume every stream in it, follow the rest."""
        self.feed = KVEventFeed(self.table, self.config.block_size, replayer=self.replayer)
        if self.xxh3 is not None:
            self.feed.run_learners.append(self.xxh3.learn)
        doc = None
        if self.config.snapshot_path:
            try:
                doc = snapshot.read(self.config.snapshot_path)
            except ValueError as e:  # a damaged file must not keep the indexer down: start from the workers
                log.error("%s; starting from the workers' replay buffers", e)
        resumed: set[str] = set()
        if doc is not None:
            resumed = self._restore(doc)
        for worker, pub in self.config.workers:
            if worker.rstrip("/") not in resumed:
                self.feed.follow(worker, pub)
        if self.config.pool_master:
            self.pool = PoolIndexFollower(self.config.pool_master, self.config.pool_secret, self.table)
            if doc is not None:
                self.resume_pool(self.pool, doc)
        if self.config.snapshot_path and self.config.snapshot_interval_s > 0:
            self._task = asyncio.create_task(self._every())
        if self.config.dns:
            members = FeedMembership(self, self.config.kv_events_port, tuple(t.role for t in self.config.dns))
            self._dns_task = asyncio.create_task(follow_dns(members, self.config.dns,
                                                            self.config.discovery_interval_s))

    def _restore(self, doc: dict[str, Any]) -> set[str]:
        assert self.feed is not None
        t0 = time.perf_counter()
        n = 0
        resumed = set()
        for s in doc["streams"]:
            if int(s["block_size"]) != self.config.block_size:
                log.warning("snapshot stream of %s has block size %s, not %d: not resumed", s["worker"],
                            s["block_size"], self.config.block_size)
                continue
            tr = snapshot.restore_translator(s)
            for tier, m in tr.tiers.items():
                self.table.blocks_stored(holder_of(s["worker"], tier), list(m.values()))
                n += len(m)
            self.feed.resume(s["worker"], Publisher(s["endpoint"], s["replay"]), tr, tr.last_digest)
            resumed.add(s["worker"])
        if self.xxh3 is not None and doc.get("xxh3") and not self.xxh3.restore(doc["xxh3"]):
            log.warning("snapshot's XXH3 map has another seed: XXH3 lookups find only blocks stored from now on")
        pool = doc.get("pool")
        if pool and self.config.pool_master:
            keys, disk = snapshot.pool_keys(pool), snapshot.pool_disk_keys(pool)
            self.table.blocks_stored(POOL, keys)
            self.table.blocks_stored(DISK_HOLDER, disk)
            n += len(keys) + len(disk)
        self.stats.restored_blocks = n
        self.stats.restore_s = time.perf_counter() - t0
        log.info("restored %d blocks of %d streams from %s in %.3f s", n, len(resumed), self.config.snapshot_path,
                 self.stats.restore_s)
        return resumed

    def resume_pool(self, follower: PoolIndexFollower, doc: dict[str, Any]) -> None:
        """The pool's log read on from the snapshot's position (its keys are in the table already): the master's
        next events when its epoch is the same, else its resync."""
        pool = doc.get("pool")
        if pool:
            follower.epoch, follower.since = pool["epoch"], int(pool["since"])

    # ---- membership (Mooncake's /register, /unregister) ----
    def register(self, worker: str, publisher: Publisher) -> None:
        assert self.feed is not None
        self.feed.follow(worker, publisher)

    def followed(self) -> list[str]:
        """The workers whose KV events are followed (registered, resumed or given at start)."""
        assert self.feed is not None
        return [w for w, st in self.feed.streams.items() if st.publisher is not None]

    def unregister(self, worker: str) -> bool:
        assert self.feed is not None
        worker = worker.rstrip("/")
        known = worker in self.feed.streams
        self.feed.forget(worker)
        self.table.forget_owner(worker)
        return known

    # ---- snapshots ----
    def capture(self) -> dict[str, Any]:
        """The state as of now, between two batches (synchronous: nothing is applied meanwhile)."""
        assert self.feed is not None
        streams = []
        for worker, st in self.feed.streams.items():
            if st.publisher is None or st.translator.last_seq is None:
                continue
            streams.append(snapshot.capture_stream(worker, st.publisher.endpoint, st.publisher.replay,
                                                   st.translator))
        pool = None
        if self.pool is not None and self.pool.epoch is not None:
            pool = snapshot.capture_pool(self.pool.epoch, self.pool.since, self.table.index.keys_of(POOL),
                                         self.table.index.keys_of(DISK_HOLDER))
        return snapshot.document(streams, pool, self.xxh3.capture() if self.xxh3 is not None else None)

    async def snapshot_now(self) -> SnapshotStats:
        """Capture on the loop, write off it; one at a time."""
        async with self._lock:
            t0 = time.perf_counter()
            doc = self.capture()
            blocks = self.table.entries()  # what ``doc`` holds: the loop applies events while the file is written
            t1 = time.perf_counter()
            size = await asyncio.to_thread(snapshot.write, self.config.snapshot_path, doc)
            t2 = time.perf_counter()
            self.stats.capture_s, self.stats.write_s, self.stats.bytes = t1 - t0, t2 - t1, size
            self.stats.blocks = blocks
            self.stats.taken += 1
            return self.stats

    async def _every(self) -> None:
        while True:
            await asyncio.sleep(self.config.snapshot_interval_s)
            try:
                await self.snapshot_now()
            except asyncio.CancelledError:
                raise
            except Exception:  # a full disk must not stop the indexer
                log.exception("snapshot to %s failed", self.config.snapshot_path)

    # ---- views ----
    def streams(self) -> dict[str, dict[str, Any]]:
        assert self.feed is not None
        return {w: {"endpoint": st.publisher.endpoint if st.publisher else "",
                    "last_seq": st.translator.last_seq, "catching_up": st.catching_up is not None,
                    "batches": self.feed.batches.get(w, 0)} for w, st in self.feed.streams.items()}

    def counters(self) -> dict[str, Any]:
        assert self.feed is not None
        f = self.feed
        return {"replayed": f.replayed, "duplicates": f.duplicates, "clears": f.clears,
                "skipped_blocks": f.skipped_blocks, "bad_batches": f.bad_batches,
                "placeholders": len(self.table.placeholders), "placeholders_confirmed":
                self.table.placeholders.confirmed, "placeholders_expired": self.table.placeholders.expired,
                "pool_resyncs": self.pool.resyncs if self.pool else 0,
                "xxh3_blocks": len(self.xxh3) if self.xxh3 is not None else None,
                "xxh3_unchained": self.xxh3.unchained if self.xxh3 is not None else None}

    async def close(self, final_snapshot: bool = True) -> None:
        for task in (self._task, self._dns_task):
            if task is not None:
                task.cancel()
        if final_snapshot and self.config.snapshot_path and self.feed is not None:
            try:
                await self.snapshot_now()
            except Exception:
                log.exception("final snapshot failed")
        if self.pool is not None:
            await self.pool.close()
        if self.feed is not None:
            await self.feed.close()
