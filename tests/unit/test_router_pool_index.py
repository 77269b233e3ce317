"""The router's follower of the KV pool master's event log (the master's RPC replaced by a scripted fake)."""

from __future__ import annotations

import asyncio

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
from pdserve.router.fleet.pool_index import DISK_HOLDER, HOLDER, PoolIndexFollower


class FakeMaster:
    def __init__(self) -> None:
        self.epoch = "e1"
        self.log: list[tuple[int, str, int]] = []
        self.keys: set[int] = set()
        self.disk: set[int] = set()  # of keys, those on a node's SSD only
        self.reset = False
        self.down = False

    def do(self, kind: str, key: int) -> None:
        self.log.append((len(self.log), kind, key))
        if kind in ("stored", "removed"):
            (self.keys.add if kind == "stored" else self.keys.discard)(key)
            self.disk.discard(key)
        else:
            (self.disk.add if kind == "spilled" else self.disk.discard)(key)

    def call(self, method: str, **kw):
        if self.down:
            raise OSError("connection refused")
        if method == "keys":
            return sorted(self.keys)
        if method == "disk_keys":
            return sorted(self.disk)
        since = kw["since"]
        return {"events": [list(e) for e in self.log if e[0] >= since], "next": len(self.log),
                "reset": self.reset, "epoch": self.epoch}


def _follower(master: FakeMaster) -> tuple[PoolIndexFollower, Conductor]:
    c = Conductor(ConductorConfig(block_size=4), OnlineCostModel(1))
    f = PoolIndexFollower.__new__(PoolIndexFollower)
    f.rpc, f.conductor, f.epoch, f.since, f.applied, f.resyncs, f.reachable = master, c, None, 0, 0, 0, False
    return f, c


def test_resync_then_events_in_order():
    m = FakeMaster()
    m.do("stored", 1)
    m.do("stored", 2)
    f, c = _follower(m)
    f.poll_once()  # first contact: full resync from keys()
    assert c.index.prefix_lengths([1, 2, 3]) == {HOLDER: 2} and f.resyncs == 1
    m.do("stored", 3)
    m.do("removed", 2)
    m.do("stored", 2)
    m.do("removed", 1)
    f.poll_once()
    assert c.index.prefix_lengths([1, 2, 3]) == {} and c.index.holds(HOLDER, 2) and c.index.holds(HOLDER, 3)
    m.epoch = "e2"  # master restarted: its nodes re-registered only key 3
    m.keys = {3}
    m.log = []
    f.poll_once()
    assert f.resyncs == 2 and c.index.blocks_of(HOLDER) == 1 and c.index.holds(HOLDER, 3)


def test_master_unreachable_forgets_pool():
    m = FakeMaster()
    m.do("stored", 1)
    f, c = _follower(m)
    f.poll_once()
    assert c.index.blocks_of(HOLDER) == 1
    m.down = True

    async def one_round():
        f.interval_s = 0.01
        f.task = asyncio.create_task(f._run())
        await asyncio.sleep(0.05)
        await f.close()

    asyncio.run(one_round())
    assert c.index.blocks_of(HOLDER) == 0 and f.epoch is None and not f.reachable


def test_spilled_and_promoted_objects_change_tier():
    """The master logs an object spilled to SSD only and promoted back: the index moves it between the pool's
    memory (``pool``) and disk (``pool#pool_disk``) holders, and a resync reads both tiers."""
    m = FakeMaster()
    for k in (1, 2, 3):
        m.do("stored", k)
    f, c = _follower(m)
    f.poll_once()
    m.do("spilled", 1)
    m.do("spilled", 2)
    m.do("promoted", 1)
    m.do("removed", 2)
    m.do("spilled", 3)
    f.poll_once()
    assert c.index.keys_of(HOLDER) == {1} and c.index.keys_of(DISK_HOLDER) == {3}
    assert c.index.prefix_lengths([1]) == {HOLDER: 1}
    m.epoch = "e2"  # a resync splits the pool's keys by tier
    f.poll_once()
    assert c.index.keys_of(HOLDER) == {1} and c.index.keys_of(DISK_HOLDER) == {3} and f.resyncs == 2
    m.log.append((len(m.log), "moved_to_mars", 1))  # a kind this follower does not know: dropped, never kept
    f.poll_once()
    assert c.index.keys_of(HOLDER) == set()


def test_a_master_without_tier_events_still_counts_its_pool():
    """A master older than its tier log (no disk_keys call, no spilled events): every pooled object is the pool's
    memory tier, as before tiers, rather than the pool being dropped."""
    from pdserve.store.rpc import StoreError

    class OldMaster(FakeMaster):
        def call(self, method: str, **kw):
            if method == "disk_keys":
                raise StoreError("protocol", "unknown call 'disk_keys'; this is pdserve-store-master")
            return super().call(method, **kw)

    m = OldMaster()
    m.do("stored", 1)
    f, c = _follower(m)
    f.poll_once()
    assert c.index.keys_of(HOLDER) == {1} and f.resyncs == 1
