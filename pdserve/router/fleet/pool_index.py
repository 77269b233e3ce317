"""Follows the KV pool master's event log into the conductor's prefix index, so placement counts pooled prefixes
as loadable instead of computed (the connector loads them before prefill): objects in a node's memory under holder
``pool`` (tier pool_memory), objects spilled to a node's SSD only under ``pool#pool_disk`` (tier pool_disk; the
master logs ``spilled`` and ``promoted`` as an object leaves or re-enters memory), each priced at its tier's cost.

The master keeps metadata only; ``events(since)`` returns stored/removed keys in order with an epoch. A new
epoch (master restarted) or ``reset`` (log overflowed) triggers a full resync from ``keys()``. While the master
is unreachable the pool's entries are dropped: the conductor then assumes nothing is pooled (never more).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ...conductor.events import IndexLike
from ...conductor.tiers import POOL, POOL_DISK, holder_of
from .follower import Follower

log = logging.getLogger("pdserve.router.pool_index")
HOLDER = "pool"  # the pool's memory tier
DISK_HOLDER = holder_of(POOL, POOL_DISK)  # "pool#pool_disk": pooled objects on a node's SSD only


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
            keys = [int(k) for k in self.rpc.call("keys")]
            disk = self._disk_keys()
            self.forget_tiers()
            self.conductor.blocks_stored(HOLDER, [k for k in keys if k not in disk])
            self.conductor.blocks_stored(DISK_HOLDER, [k for k in keys if k in disk])
            self.epoch, self.since = r.get("epoch"), int(r.get("next", 0))
            self.resyncs += 1
            return
        run: list[int] = []  # consecutive "stored" keys, applied as one batch
        for _, kind, key in r.get("events", []):
            if kind == "stored":
                run.append(int(key))
            else:
                if run:
                    self.conductor.blocks_stored(HOLDER, run)
                    run = []
                self._apply(kind, int(key))
            self.applied += 1
        if run:
            self.conductor.blocks_stored(HOLDER, run)
        self.since = int(r.get("next", self.since))

    def _disk_keys(self) -> set[int]:
        """The master's keys on SSD only; none from a master older than its tier events (it logs no spills, so
        its pooled objects all count as memory, as before tiers)."""
        from ...store.rpc import StoreError

        try:
            return {int(k) for k in self.rpc.call("disk_keys")}
        except StoreError as e:
            if e.code != "protocol":
                raise
            log.warning("KV pool master has no disk tier log (%s): its objects all count as its memory tier", e)
            return set()

    def _apply(self, kind: str, key: int) -> None:
        """A tier move or a removal. An unknown kind drops the key from both tiers (the index may under-state
        the pool, never over-state it)."""
        if kind == "spilled":
            self.conductor.blocks_removed(HOLDER, [key])
            self.conductor.blocks_stored(DISK_HOLDER, [key])
        elif kind == "promoted":
            self.conductor.blocks_removed(DISK_HOLDER, [key])
            self.conductor.blocks_stored(HOLDER, [key])
        else:
            self.conductor.blocks_removed(HOLDER, [key])
            self.conductor.blocks_removed(DISK_HOLDER, [key])

    async def step(self) -> None:
        await asyncio.to_thread(self.poll_once)

    def forget_tiers(self) -> None:
        self.conductor.all_cleared(HOLDER)
        self.conductor.all_cleared(DISK_HOLDER)

    def forget(self) -> None:
        self.epoch = None
        self.forget_tiers()
