"""The log of placeholders posted (``POST /expect``), read by every router replica (``GET /expect?since=N``) so each
applies the others' fresh placements to its own index (:mod:`pdserve.router.fleet.placeholders`). Bounded: the
newest ``limit`` posts; a reader that fell further behind gets what is left (its misses only cost a prefix hit)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


class ExpectLog:
    def __init__(self, ttl_s: float, clock: Callable[[], float], limit: int = 10_000) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self.entries: deque[tuple[int, float, dict[str, Any]]] = deque(maxlen=limit)  # (seq, posted at, entry)
        self.next = 0

    def add(self, worker: str, keys: list[int], origin: str) -> int:
        seq, self.next = self.next, self.next + 1
        self.entries.append((seq, self.clock(), {"instance_id": worker, "seq_hashes": keys, "origin": origin}))
        return seq

    def since(self, seq: int) -> list[dict[str, Any]]:
        """The posts from ``seq`` on (``seq`` < 0: those still alive, for a reader that just started)."""
        now = self.clock()
        if seq < 0:
            return [e for _, at, e in self.entries if now - at < self.ttl_s]
        return [e for s, _, e in self.entries if s >= seq]
