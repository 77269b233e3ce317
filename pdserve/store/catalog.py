"""The master's metadata: objects (key -> size, replicas, lease, last use), nodes (arena allocator, SSD
bytes, liveness, a journal of changes for the node); the records are in :mod:`.records` and the eviction
policy in :mod:`.eviction`. Pure Python, no sockets: the
master server (:mod:`pdserve.store.master`) drives it and carries out the data moves it plans; unit tests
drive it directly with a fake clock.

Object life: ``put_start`` allocates space on ``replicas`` distinct nodes (not yet visible), the client
writes the bytes straight into the nodes' arenas, ``put_end`` makes it visible (LRU newest). ``get_start``
leases visible objects (a leased object is neither evicted nor removed) and returns where they are; an
object only on SSD is first promoted into its node's arena (the master asks the node; the node copies
file -> arena). ``release`` ends a lease early.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .eviction import Eviction
from .records import MEM, METRIC_COUNTERS, SSD, Node, Obj, Replica
from .tiers import ArenaAllocator


class Catalog(Eviction):
    def __init__(self, replicas: int = 1, high_watermark: float = 0.9, low_watermark: float = 0.75,
                 lease_s: float = 5.0, node_timeout_s: float = 3.0, put_timeout_s: float = 30.0,
                 events_kept: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.replicas = replicas
        self.high, self.low = high_watermark, low_watermark
        self.lease_s = lease_s
        self.node_timeout_s = node_timeout_s
        self.put_timeout_s = put_timeout_s
        self.clock = clock
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.nodes: dict[str, Node] = {}
        self.objects: dict[int, Obj] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # visible objects, least recently used first
        self.counters = {k: 0 for k in METRIC_COUNTERS}
        self.events: deque = deque(maxlen=events_kept)  # (seq, "stored" | "removed" | "spilled" | "promoted", key)
        self.event_seq = 0
        self.epoch = uuid.uuid4().hex[:12]  # changes when the master restarts: event readers resync

    # ------------------------------------------------------------------ nodes
    def register_node(self, node_id: str, rpc: Sequence[Any], segment: dict[str, Any], mem_capacity: int,
                      ssd_capacity: int, objects: Iterable[Sequence[Any]] = ()) -> dict[str, Any]:
        """A node (re)joins with what it holds: ``objects`` = (key, tier, offset, size). Returns counts."""
        with self.lock:
            if node_id in self.nodes:
                self._drop_node(node_id, count=False)
            node = Node(node_id, (str(rpc[0]), int(rpc[1])), segment, ArenaAllocator(mem_capacity), ssd_capacity,
                        self.clock())
            self.nodes[node_id] = node
            adopted = rejected = 0
            for key, tier, offset, size in objects:
                key, size, offset = int(key), int(size), int(offset)
                obj = self.objects.get(key)
                if obj is not None and (obj.size != size or not obj.committed or obj.on(node_id, tier)):
                    rejected += 1
                    continue
                if tier == MEM:
                    if not node.mem.reserve(offset, size):
                        rejected += 1
                        continue
                elif tier == SSD:
                    node.ssd_used += size
                else:
                    rejected += 1
                    continue
                new = obj is None
                if obj is None:
                    obj = Obj(key, size, [], self.clock(), committed=True)
                    self.objects[key] = obj
                    self.lru[key] = None
                    self._event("stored", key)
                had_mem = new or any(r.tier == MEM for r in obj.replicas)
                obj.replicas.append(Replica(node_id, tier, offset))
                self._tier_event(obj, had_mem)  # an SSD-only object adopted: stored, then spilled
                adopted += 1
            self.cond.notify_all()
            return {"adopted": adopted, "rejected": rejected}

    def heartbeat(self, node_id: str, ack: int) -> dict[str, Any] | None:
        """None: unknown node (the master restarted or dropped it): it must register again."""
        with self.lock:
            node = self.nodes.get(node_id)
            if node is None:
                return None
            node.last_seen = self.clock()
            while node.journal and node.journal[0][0] <= ack:
                node.journal.popleft()
            return {"events": [list(e) for e in node.journal]}

    def drop_silent_nodes(self) -> list[str]:
        now = self.clock()
        with self.lock:
            silent = [n for n, node in self.nodes.items() if now - node.last_seen > self.node_timeout_s]
            for node_id in silent:
                self._drop_node(node_id)
            return silent

    def _drop_node(self, node_id: str, count: bool = True) -> None:
        self.nodes.pop(node_id, None)
        if count:
            self.counters["nodes_dropped"] += 1
        for key, obj in list(self.objects.items()):
            before = len(obj.replicas)
            had_mem = any(r.tier == MEM for r in obj.replicas)
            obj.replicas = [r for r in obj.replicas if r.node != node_id]
            self._tier_event(obj, had_mem)
            if obj.promoting == node_id:
                obj.promoting = ""
            if before and not obj.replicas:
                self._delete(key)
        self.cond.notify_all()

    # ------------------------------------------------------------------ puts
    def put_start(self, keys: Sequence[int], sizes: Sequence[int], replicas: int | None = None) -> list[dict]:
        want = max(1, replicas or self.replicas)
        out: list[dict] = []
        now = self.clock()
        with self.lock:
            for key, size in zip(keys, sizes):
                key, size = int(key), int(size)
                if key in self.objects:
                    self.counters["put_exists"] += 1
                    out.append({"s": "exists"})
                    continue
                placed: list[Replica] = []
                for node in sorted(self.nodes.values(), key=lambda n: -n.mem.free_bytes):
                    if len(placed) == want:
                        break
                    offset = node.mem.alloc(size)
                    if offset is not None:
                        placed.append(Replica(node.node_id, MEM, offset))
                if not placed:
                    self.counters["put_full"] += 1
                    out.append({"s": "full"})
                    continue
                self.objects[key] = Obj(key, size, placed, now)
                out.append({"s": "alloc", "r": [[r.node, r.offset] for r in placed]})
        return out

    def put_end(self, keys: Sequence[int], ok: Sequence[bool]) -> int:
        """Make written objects visible (or free failed ones); returns how many became visible."""
        done = 0
        with self.lock:
            for key, good in zip(keys, ok):
                obj = self.objects.get(int(key))
                if obj is None or obj.committed:
                    continue
                if not good or not obj.replicas:
                    self._delete(obj.key)
                    continue
                obj.committed = True
                self.lru[obj.key] = None
                for r in obj.replicas:
                    self.nodes[r.node].log("add", obj.key, MEM, r.offset, obj.size)
                self.counters["puts"] += 1
                self.counters["put_bytes"] += obj.size
                self._event("stored", obj.key)
                done += 1
        return done

    def reclaim_stale_puts(self) -> int:
        now = self.clock()
        with self.lock:
            stale = [k for k, o in self.objects.items() if not o.committed and now - o.created > self.put_timeout_s]
            for key in stale:
                self._delete(key)
            self.counters["stale_puts"] += len(stale)
            return len(stale)

    # ------------------------------------------------------------------ gets
    def _leased(self, obj: Obj, now: float) -> bool:
        if obj.readers and now >= obj.lease_until:
            obj.readers = 0
        return obj.readers > 0

    def get_start(self, keys: Sequence[int], nospace: bool = False) -> list[dict]:
        """Per key: ``{"s": "mem", "r": [[node, offset], ...], "size": n}`` (leased), ``{"s": "promote",
        "node", "offset", "size"}`` (caller copies file -> arena, then :meth:`finish_promote`), ``{"s":
        "wait"}`` (someone else is promoting it) or ``{"s": "miss"}``. With ``nospace``, an SSD-only object
        whose node has no arena room answers ``{"s": "nospace", "node", "size"}`` (the caller makes room
        with :meth:`make_room` and asks again) instead of a miss."""
        now = self.clock()
        out: list[dict] = []
        with self.lock:
            for key in keys:
                obj = self.objects.get(int(key))
                if obj is None or not obj.committed or obj.doomed or not obj.replicas:
                    self.counters["misses"] += 1
                    out.append({"s": "miss"})
                    continue
                mems = [r for r in obj.replicas if r.tier == MEM]
                if mems:
                    self._lease(obj, now)
                    self.lru.move_to_end(obj.key)
                    self.counters["hits"] += 1
                    self.counters["hits_mem"] += 1
                    self.counters["get_bytes_mem"] += obj.size
                    out.append({"s": "mem", "r": [[r.node, r.offset] for r in mems], "size": obj.size})
                    continue
                if obj.promoting:
                    self.counters["lease_waits"] += 1
                    out.append({"s": "wait"})
                    continue
                placed = None
                for r in obj.replicas:
                    offset = self.nodes[r.node].mem.alloc(obj.size)
                    if offset is not None:
                        placed = (r.node, offset)
                        break
                if placed is None and nospace:
                    out.append({"s": "nospace", "node": obj.replicas[0].node, "size": obj.size})
                    continue
                if placed is None:  # no arena room next to any SSD copy: a miss
                    self.counters["misses"] += 1
                    self.counters["promote_failures"] += 1
                    out.append({"s": "miss"})
                    continue
                obj.promoting = placed[0]
                self._lease(obj, now)
                out.append({"s": "promote", "node": placed[0], "offset": placed[1], "size": obj.size})
        return out

    def _lease(self, obj: Obj, now: float) -> None:
        self._leased(obj, now)
        obj.readers += 1
        obj.lease_until = max(obj.lease_until, now + self.lease_s)

    def finish_promote(self, key: int, node_id: str, offset: int, size: int, ok: bool) -> bool:
        with self.lock:
            obj = self.objects.get(key)
            node = self.nodes.get(node_id)
            good = ok and obj is not None and obj.promoting == node_id and node is not None
            if obj is not None and obj.promoting == node_id:
                obj.promoting = ""
            if good and obj is not None and node is not None:  # (good implies both; said again for the checker)
                had_mem = any(r.tier == MEM for r in obj.replicas)
                obj.replicas.append(Replica(node_id, MEM, offset))
                self._tier_event(obj, had_mem)
                node.log("add", key, MEM, offset, obj.size)
                self.lru.move_to_end(key)
                self.counters["hits"] += 1
                self.counters["hits_ssd"] += 1
                self.counters["promotes"] += 1
                self.counters["get_bytes_ssd"] += obj.size
            else:
                if node is not None:
                    node.mem.free(offset, size)
                self.counters["promote_failures"] += 1
                self.counters["misses"] += 1
                if obj is not None:
                    self._unlease(obj)
            self.cond.notify_all()
            return good

    def wait_promotions(self, keys: Sequence[int], timeout_s: float) -> None:
        deadline = self.clock() + timeout_s
        with self.cond:
            while True:
                busy = [k for k in keys if (o := self.objects.get(int(k))) is not None and o.promoting]
                left = deadline - self.clock()
                if not busy or left <= 0:
                    return
                self.cond.wait(min(left, 0.05))

    def release(self, keys: Sequence[int]) -> None:
        with self.lock:
            for key in keys:
                obj = self.objects.get(int(key))
                if obj is not None:
                    self._unlease(obj)

    def _unlease(self, obj: Obj) -> None:
        if obj.readers:
            obj.readers -= 1
        if obj.readers == 0:
            obj.lease_until = 0.0
            if obj.doomed:
                self._delete(obj.key)
                self.counters["removed"] += 1

    # ------------------------------------------------------------------ queries
    def exists(self, keys: Sequence[int]) -> list[bool]:
        with self.lock:
            return [self._visible(int(k)) for k in keys]

    def _visible(self, key: int) -> bool:
        obj = self.objects.get(key)
        return obj is not None and obj.committed and not obj.doomed and bool(obj.replicas)

    def prefix(self, keys: Sequence[int]) -> int:
        """How many leading keys are in the pool (a chained prefix stops at its first gap)."""
        with self.lock:
            n = 0
            for k in keys:
                if not self._visible(int(k)):
                    break
                n += 1
            return n

    def remove(self, keys: Sequence[int]) -> int:
        now = self.clock()
        removed = 0
        with self.lock:
            for key in keys:
                obj = self.objects.get(int(key))
                if obj is None:
                    continue
                if self._leased(obj, now):
                    obj.doomed = True
                    self.counters["lease_waits"] += 1
                    continue
                self._delete(obj.key)
                self.counters["removed"] += 1
                removed += 1
        return removed

    def keys(self) -> list[int]:
        with self.lock:
            return [k for k in self.lru if self._visible(k)]

    def disk_keys(self) -> list[int]:
        """Visible keys held on SSD only (the pool's disk tier; the rest of :meth:`keys` is in memory)."""
        with self.lock:
            return [k for k in self.lru if self._visible(k) and
                    not any(r.tier == MEM for r in self.objects[k].replicas)]

    def events_since(self, since: int, limit: int = 10000) -> dict[str, Any]:
        """Stored/removed events with seq > since, and spilled/promoted (a pooled object now on SSD only, or back
        in memory). ``reset``: events were dropped since then; re-read
        :meth:`keys` and continue from ``next``. ``epoch`` changes when the master restarts (its sequence
        starts again): a reader that sees a new epoch resyncs the same way."""
        with self.lock:
            oldest = self.events[0][0] if self.events else self.event_seq + 1
            reset = since + 1 < oldest and since < self.event_seq
            out = [list(e) for e in self.events if e[0] > since][:limit]
            nxt = out[-1][0] if out else max(since, self.event_seq) if not reset else self.event_seq
            return {"events": out, "next": nxt, "reset": reset, "epoch": self.epoch}

    # ------------------------------------------------------------------ eviction
    def _delete(self, key: int) -> None:
        obj = self.objects.pop(key, None)
        if obj is None:
            return
        self.lru.pop(key, None)
        for r in obj.replicas:
            node = self.nodes.get(r.node)
            if node is None:
                continue
            if r.tier == MEM:
                node.mem.free(r.offset, obj.size)
                if obj.committed:
                    node.log("del", key, MEM)
            else:
                node.ssd_used -= obj.size
                node.log("del", key, SSD)
        if obj.committed:
            self._event("removed", key)

    def _event(self, kind: str, key: int) -> None:
        self.event_seq += 1
        self.events.append((self.event_seq, kind, key))

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, Any]:
        with self.lock:
            mem_used = sum(n.mem.used for n in self.nodes.values())
            mem_cap = sum(n.mem.capacity for n in self.nodes.values())
            ssd_used = sum(n.ssd_used for n in self.nodes.values())
            ssd_cap = sum(n.ssd_capacity for n in self.nodes.values())
            objs_mem = sum(1 for o in self.objects.values() if any(r.tier == MEM for r in o.replicas))
            objs_ssd = sum(1 for o in self.objects.values() if any(r.tier == SSD for r in o.replicas))
            leased = sum(1 for o in self.objects.values() if o.readers and self.clock() < o.lease_until)
            return {**self.counters, "nodes": len(self.nodes), "objects": len(self.lru),
                    "objects_mem": objs_mem, "objects_ssd": objs_ssd, "leased": leased,
                    "bytes_mem": mem_used, "capacity_mem": mem_cap, "bytes_ssd": ssd_used,
                    "capacity_ssd": ssd_cap, "event_seq": self.event_seq}

    def segments(self, node_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {n: self.nodes[n].segment for n in set(node_ids) if n in self.nodes}
