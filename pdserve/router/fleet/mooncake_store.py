"""Follows Mooncake Store (``--pool-backend mooncake``) into the conductor's prefix index (holder ``pool``, as
pdserve's own pool in :mod:`.pool_index`), so placement counts blocks pooled in the store as loadable.

What the store offers (the mooncake wheel in .venv, 0.3.13, non-CUDA build): the master's HTTP admin server, on its
metrics port, answers ``/get_all_keys`` (one key a line), ``/query_key`` and ``/batch_query_keys``. Its KV event
publisher (``mooncake_master --enable_kv_events``, ZMQ) is not in this build: with the flag set
``/kv_events/status`` still answers ``"enabled": false`` and nothing is published. So the view polls the key
listing and applies the difference; a build that publishes events could feed :meth:`StoreView.listing` the same
way (not done: none here to test against).

Keys. vLLM's MooncakeStoreConnector names a block ``<model>@tp_rank:R@pcpC@dcpD@pp_rank:P@group:G@<hex>``: the
model folder's name, the rank's shard, and the hex of vLLM's block hash (sha256, deterministic across workers).
The view counts the rank-0, group-0 key of the router's model (:func:`key_prefix`). vLLM's hashes are not
pdserve's keys, and the router computes no vLLM hash: the workers' KV events carry both a stored block's vLLM hash
(by default its low 64 bits, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) and its tokens, which the event translator
keys. The view remembers the (hash, key) pairs of every worker's stored blocks (bounded, oldest forgotten first),
so a block still resolves after its worker evicted it while the store holds it. A pooled block whose hash it never
learned is not counted: an under-estimate, never an over-estimate. While the master is unreachable the store's
entries are dropped.

Cost: one listing per ``interval_s`` (about 100 bytes a key, parsed off the event loop); a store with millions of
keys wants the event publisher instead.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path

from ...conductor.events import IndexLike
from .follower import Follower

log = logging.getLogger("pdserve.router.fleet.mooncake_store")
HOLDER = "pool"  # the conductor's fetchable holder, whichever pool backs it
MASK64 = (1 << 64) - 1
KNOWN_LIMIT = 1 << 18  # (hash, key) pairs remembered: 262,144 blocks (33M tokens at 128), ~40 MB


def key_prefix(model_dir: str) -> str:
    """The rank-0, group-0 key prefix of a model's blocks (vLLM names the model by its folder's name)."""
    return f"{Path(model_dir.rstrip('/')).name}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"


def hash64(block_hash: Hashable) -> int | None:
    """A vLLM block hash as published in KV events (an int, or the digest's bytes) -> its low 64 bits."""
    if isinstance(block_hash, int):
        return block_hash & MASK64
    if isinstance(block_hash, (bytes, bytearray)) and len(block_hash) >= 8:
        return int.from_bytes(block_hash[-8:], "big")
    return None


def parse_listing(text: str, prefix: str) -> set[int]:
    """``/get_all_keys`` -> the low 64 bits of the hashes of the keys under ``prefix``."""
    out = set()
    for line in text.splitlines():
        if line.startswith(prefix):
            digest = line[len(prefix):].strip()
            try:
                out.add(int(digest[-16:], 16))
            except ValueError:  # not one of vLLM's block keys
                continue
    return out


class StoreView:
    """What the store holds, in pdserve keys, kept in the index under :data:`HOLDER`. Pure: fed pairs and listings."""

    def __init__(self, index: IndexLike, known_limit: int = KNOWN_LIMIT) -> None:
        self.index = index
        self.known_limit = known_limit
        self.known: OrderedDict[int, int] = OrderedDict()  # vLLM hash (low 64 bits) -> our key
        self.present: set[int] = set()  # hashes the store holds
        self.counted: dict[int, int] = {}  # hashes in the index -> the key they were counted under
        self.unresolved = 0  # pooled blocks of the last listing whose hash was never learned

    def learn(self, pairs: list[tuple[Hashable, int]]) -> None:
        """(vLLM hash, our key) of blocks a worker stored; a hash the store already holds is counted now."""
        stored = []
        for block_hash, key in pairs:
            h = hash64(block_hash)
            if h is None:
                continue
            self.known[h] = key
            self.known.move_to_end(h)
            if h in self.present and h not in self.counted:
                self.counted[h] = key
                stored.append(key)
                self.unresolved = max(0, self.unresolved - 1)
        while len(self.known) > self.known_limit:
            self.known.popitem(last=False)
        if stored:
            self.index.blocks_stored(HOLDER, stored)

    def listing(self, hashes: set[int]) -> tuple[int, int]:
        """The store now holds exactly ``hashes``: count the new ones whose key is known, drop the gone ones.
        Returns (stored, removed)."""
        gone = [h for h in self.counted if h not in hashes]
        removed = [self.counted.pop(h) for h in gone]
        stored, unresolved = [], 0
        for h in hashes:
            if h in self.counted:
                continue
            key = self.known.get(h)
            if key is None:
                unresolved += 1
                continue
            self.counted[h] = key
            stored.append(key)
        self.present, self.unresolved = hashes, unresolved
        if removed:
            self.index.blocks_removed(HOLDER, removed)
        if stored:
            self.index.blocks_stored(HOLDER, stored)
        return len(stored), len(removed)

    def clear(self) -> None:
        """The store is out of reach: assume nothing is pooled (the pairs learned stay)."""
        self.present, self.counted, self.unresolved = set(), {}, 0
        self.index.all_cleared(HOLDER)


def http_listing(admin: str, timeout_s: float = 5.0) -> Callable[[], str]:
    """The master's key listing over its HTTP admin server at ``admin`` (HOST:PORT, its metrics port)."""
    url = f"http://{admin}/get_all_keys"

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return str(resp.read().decode())
    return fetch


class MooncakeStoreFollower(Follower):
    """Polls the store's listing every ``interval_s`` into a :class:`StoreView`; :meth:`learn` takes the workers'
    (hash, key) pairs (a :class:`~.kv_events.KVEventFeed` learner). Runs on the router's event loop."""

    def __init__(self, admin: str, model_dir: str, index: IndexLike, interval_s: float = 1.0,
                 fetch: Callable[[], str] | None = None) -> None:
        self.view = StoreView(index)
        self.prefix = key_prefix(model_dir)
        self.fetch = fetch or http_listing(admin)
        self.admin = admin
        self.interval_s = interval_s
        self.polls = 0
        self.source = f"Mooncake Store master {admin}"
        self.start()

    def learn(self, pairs: list[tuple[Hashable, int]]) -> None:
        self.view.learn(pairs)

    def _listed(self) -> set[int]:
        return parse_listing(self.fetch(), self.prefix)

    async def poll_once(self) -> None:
        hashes = await asyncio.to_thread(self._listed)  # fetch and parse off the loop, apply on it
        self.view.listing(hashes)
        self.polls += 1

    async def step(self) -> None:
        await self.poll_once()

    def found(self) -> None:
        log.info("Mooncake Store at %s: following its keys (%s*)", self.admin, self.prefix)

    def forget(self) -> None:
        self.view.clear()

