"""Pool client: batched put / get-into / exists / remove of immutable objects keyed by uint64 block keys.

An object is written from, and read into, a list of ranges of memory registered with the caller's
:class:`~pdserve.transfer.TransferEngine` (e.g. one range per layer of a KV block): the bytes move in one
transfer batch per node straight between those ranges and the node's arena; the master only hands out
offsets and leases.

    client = StoreClient(ClientConfig("127.0.0.1", 7600), engine)
    client.put([(key, [("kv.0", off0, n), ("kv.1", off1, n)])])        # -> ["stored"]
    client.get_into([(key, [("kv.0", dst0, n), ("kv.1", dst1, n)])])   # -> [True]
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.transfer import SegmentDescriptor, TransferEngine, TransferError

from .config import ClientConfig
from .node import ARENA
from .rpc import RpcClient, StoreError

log = logging.getLogger("pdserve.store.client")
Piece = tuple[str, int, int]  # (local region name, offset, length)
Item = tuple[int, Sequence[Piece]]  # (key, the ranges holding the object's bytes, in order)


@dataclass
class TransferStats:
    bytes: int = 0
    objects: int = 0
    failed: int = 0


class StoreClient:
    def __init__(self, config: ClientConfig, engine: TransferEngine | None = None) -> None:
        """``engine`` None: control calls only (exists/prefix/remove/keys/events/stats)."""
        self.config = config
        self.engine = engine
        self.master = RpcClient(config.master_host, config.master_port, config.secret, config.timeout_s)
        self._segments: dict[str, SegmentDescriptor] = {}
        self.last = TransferStats()

    # ---- control calls
    def exists(self, keys: Sequence[int]) -> list[bool]:
        return list(self.master.call("exists", keys=list(keys))) if keys else []

    def prefix(self, keys: Sequence[int]) -> int:
        """Number of leading keys present in the pool."""
        return int(self.master.call("prefix", keys=list(keys))) if keys else 0

    def remove(self, keys: Sequence[int]) -> int:
        return int(self.master.call("remove", keys=list(keys))) if keys else 0

    def keys(self) -> list[int]:
        return list(self.master.call("keys"))

    def events(self, since: int = 0, limit: int = 10000) -> dict[str, Any]:
        return self.master.call("events", since=since, limit=limit)

    def stats(self) -> dict[str, Any]:
        return self.master.call("stats")

    def _segment(self, node_id: str, nodes: dict[str, Any]) -> SegmentDescriptor | None:
        wire = nodes.get(node_id)
        if wire is not None:
            seg = self._segments.get(node_id)
            if seg is None or seg.engine_id != wire.get("engine_id") or seg.port != wire.get("port"):
                seg = self._segments[node_id] = SegmentDescriptor.from_wire(wire)
            return seg
        return self._segments.get(node_id)

    @staticmethod
    def _entries(pieces: Sequence[Piece], base: int) -> list[tuple[str, int, str, int, int]]:
        out, at = [], base
        for region, offset, length in pieces:
            out.append((region, offset, ARENA, at, length))
            at += length
        return out

    def _run(self, batches: dict[str, list], nodes: dict[str, Any], op: str) -> dict[str, bool]:
        """Submit one batch per node at once, then wait for all; node -> succeeded."""
        if self.engine is None:
            raise StoreError("config", "this StoreClient has no transfer engine: pass one to move data")
        handles = {}
        ok: dict[str, bool] = {}
        for node_id, entries in batches.items():
            seg = self._segment(node_id, nodes)
            if seg is None:
                ok[node_id] = False
                continue
            try:
                handles[node_id] = self.engine.submit(seg, entries, op, deadline_s=self.config.transfer_deadline_s)
            except TransferError as exc:
                log.warning("pool %s to node %s refused: %s", op, node_id, exc)
                ok[node_id] = False
        for node_id, handle in handles.items():
            try:
                handle.result()
                ok[node_id] = True
            except TransferError as exc:
                log.warning("pool %s with node %s failed: %s", op, node_id, exc)
                ok[node_id] = False
        return ok

    # ---- data calls
    def put(self, items: Sequence[Item], replicas: int | None = None) -> list[str]:
        """Store objects; per key "stored", "exists" (already pooled), "full" (no room) or "failed"."""
        if not items:
            return []
        keys = [int(k) for k, _ in items]
        sizes = [sum(p[2] for p in pieces) for _, pieces in items]
        args: dict[str, Any] = {"keys": keys, "sizes": sizes}
        if replicas:
            args["replicas"] = replicas
        reply = self.master.call("put_start", **args)
        res, nodes = reply["res"], reply["nodes"]
        batches: dict[str, list] = defaultdict(list)
        where: dict[int, list[str]] = {}
        for i, r in enumerate(res):
            if r["s"] == "alloc":
                where[i] = [n for n, _ in r["r"]]
                for node_id, offset in r["r"]:
                    batches[node_id] += self._entries(items[i][1], offset)
        ok = self._run(batches, nodes, "write") if batches else {}
        done = {i: all(ok.get(n, False) for n in ns) for i, ns in where.items()}
        if done:
            self.master.call("put_end", keys=[keys[i] for i in done], ok=list(done.values()))
        out = []
        for i, r in enumerate(res):
            out.append(("stored" if done[i] else "failed") if i in done else r["s"])
        self.last = TransferStats(sum(sizes[i] * len(where[i]) for i in done if done[i]),
                                  sum(done.values()), sum(not v for v in done.values()))
        return out

    def get_into(self, items: Sequence[Item]) -> list[bool]:
        """Read objects into the given ranges; per key True when its bytes arrived (from any replica)."""
        if not items:
            return []
        keys = [int(k) for k, _ in items]
        reply = self.master.call("get", keys=keys)
        locs, nodes = reply["loc"], reply["nodes"]
        got = [False] * len(items)
        leased = [keys[i] for i, loc in enumerate(locs) if loc]
        todo = {}
        for i, loc in enumerate(locs):
            if not loc:
                continue
            if loc["size"] != sum(p[2] for p in items[i][1]):
                log.warning("pool object %016x holds %d bytes, the caller expects %d: skipped", keys[i],
                            loc["size"], sum(p[2] for p in items[i][1]))
                continue
            todo[i] = list(loc["r"])
        nbytes = 0
        try:
            while todo:
                batches: dict[str, list] = defaultdict(list)
                members: dict[str, list[int]] = defaultdict(list)
                for i, replicas in todo.items():
                    node_id, offset = replicas.pop(0)
                    batches[node_id] += self._entries(items[i][1], offset)
                    members[node_id].append(i)
                ok = self._run(batches, nodes, "read")
                for node_id, idx in members.items():
                    for i in idx:
                        if ok[node_id]:
                            got[i] = True
                            nbytes += sum(p[2] for p in items[i][1])
                todo = {i: r for i, r in todo.items() if not got[i] and r}
        finally:
            if leased:
                try:
                    self.master.call("release", keys=leased)
                except StoreError as exc:  # the leases run out by themselves
                    log.warning("could not release %d pool leases: %s", len(leased), exc)
        self.last = TransferStats(nbytes, sum(got), len(items) - sum(got))
        return got

    def close(self) -> None:
        self.master.close()
