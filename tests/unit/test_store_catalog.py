"""The master's catalog: allocation on distinct nodes, watermarks, LRU order, leases under pressure, spill
and promote, silent nodes, re-registration after a master restart, the stored/removed event stream."""

from __future__ import annotations

from pdserve.store.catalog import MEM, SSD, Catalog


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(nodes=(("a", 1000, 0),), **kw) -> tuple[Catalog, Clock]:
    clock = Clock()
    kw.setdefault("high_watermark", 0.9)
    kw.setdefault("low_watermark", 0.5)
    cat = Catalog(clock=clock, **kw)
    for node_id, mem, ssd in nodes:
        cat.register_node(node_id, ("127.0.0.1", 1), {"engine_id": node_id}, mem * 64, ssd * 64)
    return cat, clock


def put(cat: Catalog, *keys: int, size: int = 64 * 100) -> list[dict]:
    res = cat.put_start(list(keys), [size] * len(keys))
    cat.put_end([k for k, r in zip(keys, res) if r["s"] == "alloc"], [True] * sum(r["s"] == "alloc" for r in res))
    return res


def test_replicas_go_to_distinct_nodes_and_duplicates_are_reported() -> None:
    cat, _ = make((("a", 1000, 0), ("b", 1000, 0), ("c", 1000, 0)), replicas=2)
    res = put(cat, 1)
    nodes = [n for n, _ in res[0]["r"]]
    assert len(nodes) == 2 and len(set(nodes)) == 2
    assert cat.put_start([1], [64])[0]["s"] == "exists"
    assert cat.get_start([1])[0]["s"] == "mem"


def test_put_is_invisible_until_put_end_and_failed_puts_free_space() -> None:
    cat, clock = make(put_timeout_s=5)
    cat.put_start([1, 2], [6400, 6400])
    assert cat.exists([1, 2]) == [False, False]
    cat.put_end([1, 2], [True, False])
    assert cat.exists([1, 2]) == [True, False]
    assert cat.nodes["a"].mem.used == 6400
    cat.put_start([3], [6400])
    clock.t += 6
    assert cat.reclaim_stale_puts() == 1 and cat.nodes["a"].mem.used == 6400


def test_watermarks_evict_lru_down_to_low() -> None:
    cat, _ = make()  # 64000 bytes, objects of 6400: 10 fit
    put(cat, *range(1, 10))  # 9 objects = 90%: not above high
    assert cat.plan_evictions() == [] and len(cat.keys()) == 9
    cat.get_start([1, 2])  # now 1 and 2 are the most recently used
    cat.release([1, 2])
    put(cat, 10)  # 100% > 90%: evict down to 50%
    assert cat.plan_evictions() == []  # no SSD tier: dropped, not spilled
    assert cat.nodes["a"].mem.used <= 0.5 * 64000
    assert cat.keys() == [8, 9, 1, 2, 10]  # 3..7 were the least recently used; LRU order kept
    assert cat.counters["evictions"] == 5


def test_leased_object_survives_pressure_and_remove_until_released() -> None:
    cat, clock = make(lease_s=5.0)
    put(cat, *range(1, 11))
    assert cat.get_start([1])[0]["s"] == "mem"  # leased, but also made most recent: make it oldest again
    cat.lru.move_to_end(1, last=False)
    cat.plan_evictions()
    assert cat.exists([1]) == [True] and cat.counters["lease_waits"] >= 1
    assert cat.remove([1]) == 0 and cat.objects[1].doomed  # removal waits for the lease
    cat.release([1])
    assert cat.exists([1]) == [False]
    # an expired lease no longer protects
    put(cat, 20)
    cat.get_start([20])
    clock.t += 6
    assert cat.remove([20]) == 1


def test_spill_to_ssd_then_promote_on_hit() -> None:
    cat, _ = make((("a", 1000, 1000),))
    put(cat, *range(1, 11))
    spills = cat.plan_evictions()
    assert [s.key for s in spills] == [1, 2, 3, 4, 5]  # oldest first, until low would be reached
    for s in spills:
        cat.finish_spill(s, ok=True)
    assert cat.objects[1].replicas[0].tier == SSD and cat.nodes["a"].ssd_used == 5 * 6400
    assert cat.nodes["a"].mem.used == 5 * 6400 and cat.counters["spills"] == 5
    r = cat.get_start([1])[0]
    assert r["s"] == "promote" and r["node"] == "a"
    assert cat.get_start([1])[0]["s"] == "wait"  # a second reader waits for the same promotion
    assert cat.finish_promote(1, "a", r["offset"], r["size"], ok=True)
    assert {x.tier for x in cat.objects[1].replicas} == {MEM, SSD}
    assert cat.get_start([1])[0]["s"] == "mem" and cat.counters["promotes"] == 1
    # the journal told node a about all of it, in order
    ops = [(op, key, tier) for _, op, key, tier, _, _ in cat.nodes["a"].journal if key == 1]
    assert ops == [("add", 1, MEM), ("add", 1, SSD), ("del", 1, MEM), ("add", 1, MEM)]


def test_ssd_tier_has_its_own_bound() -> None:
    cat, _ = make((("a", 1000, 300),))  # SSD holds 19200 bytes = 3 objects
    for round_ in range(4):
        put(cat, *range(round_ * 10 + 1, round_ * 10 + 11))
        for s in cat.plan_evictions():
            cat.finish_spill(s, ok=True)
        cat.plan_evictions()
        assert cat.nodes["a"].ssd_used <= 300 * 64


def test_silent_node_is_dropped_with_its_objects_and_reregistration_adopts() -> None:
    cat, clock = make((("a", 1000, 0), ("b", 1000, 0)), node_timeout_s=3)
    put(cat, 1, 2, 3, 4)
    on_a = [k for k, o in cat.objects.items() if o.replicas[0].node == "a"]
    clock.t += 2
    cat.heartbeat("b", 0)
    clock.t += 2
    assert cat.drop_silent_nodes() == ["a"]
    assert all(not x for x in cat.exists(on_a)) and cat.heartbeat("a", 0) is None
    # a fresh master (restart) learns everything from the nodes' reports
    fresh, _ = make(nodes=())
    objs = [[k, MEM, o.replicas[0].offset, o.size] for k, o in cat.objects.items()]
    assert fresh.register_node("b", ("h", 1), {}, 64000, 0, objs)["adopted"] == len(objs)
    assert fresh.exists(list(cat.objects)) == [True] * len(objs)
    assert fresh.nodes["b"].mem.used == cat.nodes["b"].mem.used
    assert fresh.put_start([99], [6400])[0]["s"] == "alloc"  # allocator knows the adopted ranges


def test_prefix_and_event_stream() -> None:
    cat, _ = make()
    put(cat, 1, 2, 4)
    assert cat.prefix([1, 2, 3, 4]) == 2
    cat.remove([2])
    ev = cat.events_since(0)
    assert [(k, key) for _, k, key in ev["events"]] == [("stored", 1), ("stored", 2), ("stored", 4), ("removed", 2)]
    assert cat.events_since(ev["next"])["events"] == [] and not ev["reset"]
    small = Catalog(events_kept=2)
    small.register_node("a", ("h", 1), {}, 64000, 0)
    put(small, 1, 2, 3)
    assert small.events_since(0)["reset"]


def test_newer_spills_displace_older_ssd_objects() -> None:
    cat, _ = make((("a", 1000, 300),))  # SSD: 3 objects
    for round_ in range(3):
        put(cat, *range(round_ * 10 + 1, round_ * 10 + 11))
        for _ in range(2):
            for s in cat.plan_evictions():
                cat.finish_spill(s, ok=True)
    on_ssd = sorted(k for k, o in cat.objects.items() if o.on("a", SSD))
    assert on_ssd and min(on_ssd) > 10, f"the oldest round should have left the SSD tier: {on_ssd}"
    assert cat.counters["ssd_drops"] > 0


def test_promotion_into_a_full_arena_makes_room_instead_of_missing() -> None:
    cat, _ = make((("a", 1000, 1000),), high_watermark=0.95, low_watermark=0.9)
    put(cat, *range(1, 10))  # 90%: no eviction pass would run
    spills = cat.make_room("a", 6400 * 3)
    for s in spills:
        cat.finish_spill(s, ok=True)
    assert [s.key for s in spills] == [1, 2] and cat.nodes["a"].mem.free_bytes == 6400 * 3  # 1 free + 2 spilled
    put(cat, 10, 11, 12)  # the arena is full again; 1 and 2 are only on SSD
    assert cat.get_start([1], nospace=True)[0] == {"s": "nospace", "node": "a", "size": 6400}
    assert cat.counters["misses"] == 0
    for s in cat.make_room("a", 6400):
        cat.finish_spill(s, ok=True)
    assert cat.get_start([1], nospace=True)[0]["s"] == "promote"


def test_tier_moves_are_logged() -> None:
    """An object spilled to SSD only is logged ``spilled``, one promoted back ``promoted``; a master restart that
    adopts an SSD-only object logs it stored then spilled; ``disk_keys`` lists the SSD-only ones."""
    cat, _ = make((("a", 1000, 1000),))
    put(cat, *range(1, 11))
    for s in cat.plan_evictions():
        cat.finish_spill(s, ok=True)
    seq = cat.event_seq
    assert cat.disk_keys() == [1, 2, 3, 4, 5]
    r = cat.get_start([2])[0]
    cat.finish_promote(2, "a", r["offset"], r["size"], ok=True)
    ev = cat.events_since(0)["events"]
    assert [(k, key) for _, k, key in ev if k != "stored"] == [("spilled", i) for i in range(1, 6)] + [("promoted", 2)]
    assert cat.event_seq == seq + 1 and cat.disk_keys() == [1, 3, 4, 5]
    fresh, _ = make(nodes=())
    fresh.register_node("b", ("h", 1), {}, 64000, 64000, [[7, SSD, -1, 6400], [8, MEM, 0, 6400]])
    assert [(k, key) for _, k, key in fresh.events_since(0)["events"]] == [("stored", 7), ("spilled", 7),
                                                                           ("stored", 8)]
