"""The catalog's eviction policy: high/low watermarks per tier, least recently used unleased objects first,
host-memory copies spilled to SSD where they fit, and the bookkeeping when a spill ends.

:class:`Eviction` is the half of :class:`~pdserve.store.catalog.Catalog` that makes room; it works on the
catalog's own tables (``objects``, ``lru``, ``nodes``, ``counters``) under the catalog's lock, so the two
halves keep one set of invariants (a leased or busy object is never evicted).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from .records import MEM, SSD, Node, Obj, Replica, Spill


class Eviction:
    objects: dict[int, Obj]
    lru: OrderedDict[int, None]
    nodes: dict[str, Node]
    counters: dict[str, int]
    lock: threading.RLock
    clock: Callable[[], float]
    high: float
    low: float

    def _leased(self, obj: Obj, now: float) -> bool:
        raise NotImplementedError

    def _event(self, kind: str, key: int) -> None:
        raise NotImplementedError

    def _tier_event(self, obj: Obj, had_mem: bool) -> None:
        """Log an object still in the pool whose host-memory presence changed: ``spilled`` (now on SSD only) or
        ``promoted`` (back in a node's memory), so readers of the log know its tier."""
        has_mem = any(r.tier == MEM for r in obj.replicas)
        if obj.committed and obj.replicas and has_mem != had_mem:
            self._event("promoted" if has_mem else "spilled", obj.key)

    def plan_evictions(self) -> list[Spill]:
        """Bring every node's tiers from above ``high`` down to ``low``: least recently used unleased objects
        first. Host-memory copies whose SSD copy exists (or that cannot spill) are dropped here; the returned
        spills are for the caller to carry out (node copies arena -> file) and report with
        :meth:`finish_spill`. SSD copies over the SSD bound are deleted here."""
        now = self.clock()
        spills: list[Spill] = []
        with self.lock:
            for node in list(self.nodes.values()):
                spills += self._evict_mem(node, now)
                self._evict_ssd(node, now)
        return spills

    def make_room(self, node_id: str, nbytes: int) -> list[Spill]:
        """Evict least recently used unleased objects from the node's arena until ``nbytes`` more fit (or at
        least down to the low watermark); returns the spills to carry out, as :meth:`plan_evictions`."""
        with self.lock:
            node = self.nodes.get(node_id)
            if node is None:
                return []
            cap = node.mem.capacity
            return self._evict_mem(node, self.clock(), min(self.low * cap, cap - nbytes))

    def _evict_mem(self, node: Node, now: float, target: float | None = None) -> list[Spill]:
        cap = node.mem.capacity
        if target is None:
            if node.mem.used <= self.high * cap:
                return []
            target = self.low * cap
        planned = 0
        spills: list[Spill] = []
        for key in list(self.lru):
            if node.mem.used - planned <= target:
                break
            obj = self.objects[key]
            rep = obj.on(node.node_id, MEM)
            if rep is None or obj.busy or obj.promoting:
                continue
            if self._leased(obj, now):
                self.counters["lease_waits"] += 1
                continue
            if obj.on(node.node_id, SSD) is None and node.ssd_capacity and \
                    node.ssd_used + obj.size <= node.ssd_capacity:
                obj.busy = True
                node.ssd_used += obj.size  # reserved until the spill ends
                planned += obj.size
                spills.append(Spill(key, node.node_id, rep.offset, obj.size))
                continue
            self._drop_replica(obj, rep)
        return spills

    def _evict_ssd(self, node: Node, now: float) -> None:
        cap = node.ssd_capacity
        if not cap or node.ssd_used <= self.high * cap:
            return
        target = self.low * cap
        for key in list(self.lru):
            if node.ssd_used <= target:
                break
            obj = self.objects[key]
            rep = obj.on(node.node_id, SSD)
            if rep is None or obj.busy or obj.promoting:
                continue
            if self._leased(obj, now):
                self.counters["lease_waits"] += 1
                continue
            self._drop_replica(obj, rep)

    def _drop_replica(self, obj: Obj, rep: Replica) -> None:
        node = self.nodes[rep.node]
        had_mem = any(r.tier == MEM for r in obj.replicas)
        obj.replicas.remove(rep)
        if rep.tier == MEM:
            node.mem.free(rep.offset, obj.size)
            self.counters["mem_drops"] += 1
        else:
            node.ssd_used -= obj.size
            self.counters["ssd_drops"] += 1
        node.log("del", obj.key, rep.tier)
        if not obj.replicas:
            self.objects.pop(obj.key, None)
            self.lru.pop(obj.key, None)
            self.counters["evictions"] += 1
            self._event("removed", obj.key)
        else:
            self._tier_event(obj, had_mem)

    def finish_spill(self, spill: Spill, ok: bool) -> None:
        with self.lock:
            node = self.nodes.get(spill.node)
            obj = self.objects.get(spill.key)
            if obj is not None:
                obj.busy = False
            if node is None:
                return
            if obj is None or not ok:
                node.ssd_used -= spill.size  # give back the reservation
                if not ok:
                    self.counters["spill_failures"] += 1
                if obj is not None and not ok and not obj.doomed:
                    rep = obj.on(node.node_id, MEM)
                    if rep is not None and not self._leased(obj, self.clock()):
                        self._drop_replica(obj, rep)
                return
            obj.replicas.append(Replica(node.node_id, SSD))
            node.log("add", obj.key, SSD, -1, obj.size)
            self.counters["spills"] += 1
            rep = obj.on(node.node_id, MEM)
            if rep is not None and not self._leased(obj, self.clock()):
                self._drop_replica(obj, rep)  # leased meanwhile: the next pass drops it (SSD copy exists)
