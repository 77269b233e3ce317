"""Placeholder entries: blocks a placement just sent to a worker, counted as that worker's until its KV event
confirms them or their life ends.

Between a placement and the worker's ``BlockStored`` (the prefill's duration plus the event's trip) the index
does not know the prompt is on its way to that worker; a second request with the same prefix placed meanwhile
would not follow it. A placeholder says "expected on worker W" for ``ttl_s`` seconds. It is never mixed with the
workers' truth: lookups report it as its own tier (``placeholder``), a stored event of the same key on W removes
it, and so do its expiry, a clear of W and the cap on entries (the oldest go first). So a placement that failed
or went elsewhere misleads for at most ``ttl_s``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

TIER = "placeholder"


class Placeholders:
    def __init__(self, ttl_s: float, limit: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self.entries: OrderedDict[tuple[str, int], float] = OrderedDict()  # (worker, key) -> expiry, oldest first
        self.by_key: dict[int, set[str]] = {}
        self.confirmed = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, worker: str, keys: Iterable[int], now: float) -> int:
        """Expect ``keys`` on ``worker`` until ``now + ttl_s``; returns how many entries were added."""
        n = 0
        for k in keys:
            e = (worker, k)
            self.entries.pop(e, None)
            self.entries[e] = now + self.ttl_s
            self.by_key.setdefault(k, set()).add(worker)
            n += 1
        while len(self.entries) > self.limit:
            self._drop(*self.entries.popitem(last=False)[0])
        return n

    def confirm(self, worker: str, keys: Iterable[int]) -> None:
        """The worker's own event stored ``keys``: their placeholders end."""
        if not self.entries:
            return
        for k in keys:
            if self.entries.pop((worker, k), None) is not None:
                self._drop(worker, k)
                self.confirmed += 1

    def clear(self, worker: str) -> None:
        for e in [e for e in self.entries if e[0] == worker]:
            del self.entries[e]
            self._drop(*e)

    def expire(self, now: float) -> int:
        """Drop every entry whose life ended; entries expire in insertion order (one ttl for all)."""
        n = 0
        while self.entries:
            e, until = next(iter(self.entries.items()))
            if until > now:
                break
            del self.entries[e]
            self._drop(*e)
            n += 1
        self.expired += n
        return n

    def holds(self, worker: str, key: int) -> bool:
        return worker in self.by_key.get(key, ())

    def workers_at(self, keys: Sequence[int]) -> set[str]:
        """The workers expected to hold any of ``keys``."""
        out: set[str] = set()
        for k in keys:
            out |= self.by_key.get(k, set())
        return out

    def _drop(self, worker: str, key: int) -> None:
        hs = self.by_key.get(key)
        if hs is not None:
            hs.discard(worker)
            if not hs:
                del self.by_key[key]
