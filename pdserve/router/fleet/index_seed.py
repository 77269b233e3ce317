"""Seed the router's prefix index from a KV indexer service (``--indexer URL``, docs/indexer.md).

A router that starts under a long-running fleet learns each worker's blocks from its replay buffer, which holds
only the last 10,000 batches: every prefix older than that is forgotten (the clear-on-gap rule). With an
indexer, the router first reads the indexer's current snapshot (``GET /snapshot``: per worker, the blocks per
tier and the batch they reflect), puts it in its own index, and resumes each worker's stream from that batch
(:meth:`~pdserve.router.fleet.kv_events.KVEventFeed.resume`), checked by its digest exactly as the indexer's own
restart is. The router then keeps its own index from the live events, as without an indexer: its placements
never wait on the indexer. An indexer that does not answer leaves the router as it was (a warning).
"""

from __future__ import annotations

import logging

import aiohttp

from ...conductor.events import IndexLike
from ...conductor.tiers import holder_of
from ...indexer.snapshot import decode, restore_translator
from .kv_events import KVEventFeed, Publisher

log = logging.getLogger("pdserve.router.fleet.index_seed")


async def seed_from_indexer(session: aiohttp.ClientSession, url: str, feed: KVEventFeed, index: IndexLike,
                            publishers: dict[str, Publisher], timeout_s: float = 10.0) -> int:
    """Resume every worker of ``publishers`` the indexer's snapshot has (same publisher, same block size);
    returns the (holder, block) entries seeded."""
    try:
        async with session.get(url.rstrip("/") + "/snapshot", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}")
            doc = decode(await r.read(), f"{url}/snapshot")
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        log.warning("indexer %s: no snapshot (%s); learning the workers' blocks from their replay only", url, e)
        return 0
    n = 0
    for s in doc["streams"]:
        worker = str(s["worker"]).rstrip("/")
        pub = publishers.get(worker)
        if pub is None or pub != Publisher(s["endpoint"], s["replay"]) or s["block_size"] != feed.block_size:
            continue
        tr = restore_translator(s)
        for tier, m in tr.tiers.items():
            index.blocks_stored(holder_of(worker, tier), list(m.values()))
            n += len(m)
        feed.resume(worker, pub, tr, tr.last_digest)
    log.info("indexer %s: seeded %d blocks of %d workers", url, n, len(doc["streams"]))
    return n
