"""Placeholders shared through the KV indexer (``--indexer URL``): each router replica posts the blocks of every
placement it makes (``POST /expect``: the worker that computes the prompt, the request's block keys) and reads
every replica's (``GET /expect?since=N``), so a replica places a prefix another replica sent to W a moment ago on
W, before W's own KV event says W holds it.

In the replica's own index a placeholder counts as W's block (:class:`ExpectingIndex`, the layer between the KV
event feed and the conductor) until W's event stores that key (confirmed: it is W's truth from then on), W
removes it or is cleared, or its life (the indexer's ``--placeholder-ttl-s``) ends: then it is removed again,
so a placement that failed or went elsewhere misleads for at most that long. Keys W already holds are not
placeholders. The replica's own placements are applied at once; another replica's about one poll later.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import aiohttp

from ...conductor import Conductor

log = logging.getLogger("pdserve.router.fleet.placeholders")

POLL_S = 0.1  # how often a replica reads the others' placeholders
POST_TIMEOUT_S = 2.0


class ExpectingIndex:
    """The conductor's index plus placeholders (an ``IndexLike`` for the KV event feed and the seed)."""

    def __init__(self, conductor: Conductor, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 limit: int = 100_000) -> None:
        self.conductor, self.ttl_s, self.clock, self.limit = conductor, ttl_s, clock, limit
        self.pending: OrderedDict[tuple[str, int], float] = OrderedDict()  # (worker, key) -> expiry, oldest first
        self.added = self.confirmed = self.expired = 0

    # ---- IndexLike: the workers' truth ----
    def blocks_stored(self, holder: str, keys: list[int]) -> None:
        if self.pending:
            for k in keys:
                if self.pending.pop((holder, k), None) is not None:
                    self.confirmed += 1
        self.conductor.blocks_stored(holder, keys)

    def blocks_removed(self, holder: str, keys: list[int]) -> None:
        for k in keys:
            self.pending.pop((holder, k), None)
        self.conductor.blocks_removed(holder, keys)

    def all_cleared(self, holder: str) -> None:
        for e in [e for e in self.pending if e[0] == holder]:
            del self.pending[e]
        self.conductor.all_cleared(holder)

    # ---- placeholders ----
    def expect(self, worker: str, keys: Sequence[int]) -> int:
        """``keys`` are on their way to ``worker``: counted as its blocks until confirmed or expired; returns how
        many placeholders were added (keys it holds already are not)."""
        self.expire()
        if worker not in self.conductor.workers:
            return 0
        index, until, new = self.conductor.index, self.clock() + self.ttl_s, []
        for k in keys:
            e = (worker, k)
            if e in self.pending:
                self.pending.move_to_end(e)
                self.pending[e] = until
            elif not index.holds(worker, k):
                self.pending[e] = until
                new.append(k)
        if new:
            self.conductor.blocks_stored(worker, new)
            self.added += len(new)
        while len(self.pending) > self.limit:
            self._drop(*self.pending.popitem(last=False)[0])
        return len(new)

    def expire(self) -> int:
        """Remove the placeholders whose life ended (one ttl for all: they end in insertion order)."""
        now, n = self.clock(), 0
        while self.pending:
            e, until = next(iter(self.pending.items()))
            if until > now:
                break
            del self.pending[e]
            self._drop(*e)
            n += 1
        self.expired += n
        return n

    def _drop(self, worker: str, key: int) -> None:
        self.conductor.blocks_removed(worker, [key])


class PlaceholderSync:
    """Posts this replica's placements to the indexer and applies every other replica's (one poll task)."""

    def __init__(self, indexer: str, session: aiohttp.ClientSession, index: ExpectingIndex,
                 poll_s: float = POLL_S) -> None:
        self.url, self.session, self.index, self.poll_s = indexer.rstrip("/"), session, index, poll_s
        self.origin = uuid.uuid4().hex[:12]  # this replica, so it skips its own entries when it reads them back
        self.since = -1  # -1: from the log's newest entry on (older ones are the past)
        self.posted = self.post_errors = self.applied = 0
        self._posts: set[asyncio.Task[None]] = set()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._poll())

    def placed(self, worker: str, keys: Sequence[int]) -> None:
        """A placement sent a prompt with block keys ``keys`` to ``worker``: expect them here, post them there."""
        if not keys:
            return
        self.index.expect(worker, keys)
        t = asyncio.create_task(self._post(worker, list(keys)))
        self._posts.add(t)
        t.add_done_callback(self._posts.discard)

    async def _post(self, worker: str, keys: list[int]) -> None:
        body = {"instance_id": worker, "seq_hashes": keys, "origin": self.origin}
        try:
            async with self.session.post(self.url + "/expect", json=body,
                                         timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S)) as r:
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
            self.posted += 1
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self.post_errors += 1
            log.debug("indexer %s: placeholder not posted (%s)", self.url, e)

    async def _poll(self) -> None:
        while True:
            try:
                self.apply(await self._read())
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                log.debug("indexer %s: placeholders not read (%s)", self.url, e)
            self.index.expire()
            await asyncio.sleep(self.poll_s)

    async def _read(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/expect", params={"since": str(self.since)},
                                    timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S)) as r:
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}")
            doc = await r.json()
        if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
            raise ValueError("unexpected /expect log")
        return doc

    def apply(self, doc: dict[str, Any]) -> None:
        """The indexer's log since the last read: every other replica's placeholders into this index."""
        self.index.ttl_s = float(doc.get("ttl_s", self.index.ttl_s))
        for e in doc["entries"]:
            if e.get("origin") != self.origin:
                self.applied += self.index.expect(str(e["instance_id"]).rstrip("/"), _ints(e["seq_hashes"]))
        self.since = int(doc.get("next", self.since))

    async def close(self) -> None:
        tasks = [t for t in [self.task, *self._posts] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _ints(values: Iterable[Any]) -> list[int]:
    return [int(v) for v in values]
