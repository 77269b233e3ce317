"""The master's metadata records: objects, their replicas, nodes and planned spills (see :mod:`.catalog`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .tiers import ArenaAllocator

MEM, SSD = "mem", "ssd"
METRIC_COUNTERS = ("hits", "misses", "hits_mem", "hits_ssd", "get_bytes_mem", "get_bytes_ssd", "puts",
                   "put_bytes", "put_exists", "put_full", "evictions", "spills", "spill_failures", "promotes",
                   "promote_failures", "mem_drops", "ssd_drops", "lease_waits", "removed", "nodes_dropped",
                   "stale_puts")


@dataclass
class Replica:
    node: str
    tier: str  # MEM or SSD
    offset: int = -1  # arena offset (MEM only)


@dataclass
class Obj:
    key: int
    size: int
    replicas: list[Replica]
    created: float
    committed: bool = False
    readers: int = 0
    lease_until: float = 0.0
    busy: bool = False  # a spill is copying it (do not plan another move)
    promoting: str = ""  # node copying it file -> arena
    doomed: bool = False  # removal asked while leased: removed when the lease ends

    def on(self, node: str, tier: str) -> Replica | None:
        return next((r for r in self.replicas if r.node == node and r.tier == tier), None)


@dataclass
class Node:
    node_id: str
    rpc: tuple[str, int]
    segment: dict[str, Any]
    mem: ArenaAllocator
    ssd_capacity: int
    last_seen: float
    ssd_used: int = 0
    journal: deque = field(default_factory=deque)  # (seq, op, key, tier, offset, size) for the node's catalog
    seq: int = 0

    def log(self, op: str, key: int, tier: str, offset: int = -1, size: int = 0) -> None:
        self.seq += 1
        self.journal.append((self.seq, op, key, tier, offset, size))


@dataclass(frozen=True)
class Spill:
    """Planned move: copy ``key`` from ``node``'s arena at ``offset`` to its SSD tier."""

    key: int
    node: str
    offset: int
    size: int
