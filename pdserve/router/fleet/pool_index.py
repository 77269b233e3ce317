"""Follows the KV pool master's event log into the conductor's prefix index (holder ``pool``), so placement
counts pooled prefixes as loadable instead of computed (the connector loads them before prefill).

The master keeps metadata only; ``events(since)`` returns stored/removed keys in order with an epoch. A new
epoch (master restarted) or ``reset`` (log overflowed) triggers a full resync from ``keys()``. While the master
is unreachable the pool's entries are dropped: the conductor then assumes nothing is pooled (never more).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ...conductor.events import IndexLike
from .follower import Follower

HOLDER = "pool"


class PoolIndexFollower(Follower):
    source = "KV pool master"

    def __init__(self, master: str, secret: str, conductor: IndexLike, interval_s: float = 1.0) -> None:
        from ...store.rpc import RpcClient  # the router only reads pool metadata, never KV bytes

        host, _, port = master.rpartition(":")
        self.rpc = RpcClient(host, int(port), secret, timeout_s=2.0)
        self.conductor = conductor
        self.interval_s = interval_s
        self.epoch: str | None = None
        self.since = 0
        self.applied = 0
        self.resyncs = 0
        self.start()

    def poll_once(self) -> None:
        """One round (blocking: run it in a thread)."""
        r: dict[str, Any] = self.rpc.call("events", since=self.since, limit=20000)
        if r.get("epoch") != self.epoch or r.get("reset"):
            # resync: everything pooled now; events after r["next"] (read before keys()) are applied next round
            keys = self.rpc.call("keys")
            self.conductor.all_cleared(HOLDER)
            self.conductor.blocks_stored(HOLDER, [int(k) for k in keys])
            self.epoch, self.since = r.get("epoch"), int(r.get("next", 0))
            self.resyncs += 1
            return
        stored: list[int] = []
        for _, kind, key in r.get("events", []):
            if kind == "stored":
                stored.append(int(key))
            else:
                if stored:
                    self.conductor.blocks_stored(HOLDER, stored)
                    stored = []
                self.conductor.blocks_removed(HOLDER, [int(key)])
            self.applied += 1
        if stored:
            self.conductor.blocks_stored(HOLDER, stored)
        self.since = int(r.get("next", self.since))

    async def step(self) -> None:
        await asyncio.to_thread(self.poll_once)

    def forget(self) -> None:
        self.epoch = None
        self.conductor.all_cleared(HOLDER)
