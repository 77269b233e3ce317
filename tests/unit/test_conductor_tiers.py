"""Placement that knows tiers (issue 39, step 2): a prefill worker starts from the cheapest of its own device
prefix or a longer prefix loaded from a tier (its own host or disk offload, the pool's memory or disk, any
worker's remote-store puts), each priced at its tier's bandwidth against computing at the learned prefill rate;
a tier's bandwidth is learned from the placements that loaded from it; a worker that leaves takes every tier."""

from __future__ import annotations

import pytest

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel, PlacementRequest
from pdserve.conductor.cost_model import Priors
from pdserve.conductor.tier_costs import TierCosts
from pdserve.hashing import block_hashes

from .fake_clock import Clock

BS = 16
PROMPT = list(range(160))  # 10 blocks
KEYS = block_hashes(PROMPT, BS)
KV = 1000  # bytes per token


def make(clock=None, pricing: str = "priced", **bandwidth: float) -> Conductor:
    # 1 ms per new token, 1 GB/s pool transfers, no overheads
    cost = OnlineCostModel(KV, Priors(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0), bandwidth_bytes_s=1e9,
                                      transfer_overhead_s=0.0, handoff_s=0.05))
    c = Conductor(ConductorConfig(block_size=BS, local_prefill_tokens=0, tier_pricing=pricing), cost, clock or Clock())
    c.tier_costs.overhead_s = 0.0
    c.tier_costs.bandwidth.update(bandwidth)
    for w in ("p0", "p1"):
        c.add_worker(w, "prefill", 0)
    c.add_worker("d0", "decode", 100_000)
    return c


def req(rid: str) -> PlacementRequest:
    return PlacementRequest(rid, len(PROMPT), KEYS, 8)


def test_own_host_tier_loaded_when_cheaper_than_computing():
    c = make(host=1e8)  # 100 MB/s: 96 tokens x 1000 B = 0.96 ms, against 96 ms of compute
    c.blocks_stored("p0", KEYS[:2])
    c.blocks_stored("p0#host", KEYS[:8])
    d = c.place(req("r"))
    assert (d.prefill, d.cached_tokens, d.fetch_tokens, d.fetch_tier) == ("p0", 128, 96, "host")
    assert d.ttft_s == pytest.approx(96 * KV / 1e8 + 0.032)


def test_a_slow_tier_is_not_worth_loading():
    c = make(host=1e4)  # 10 KB/s: 9.6 s to load, 96 ms to compute
    c.blocks_stored("p0", KEYS[:2])
    c.blocks_stored("p0#host", KEYS[:8])
    d = c.place(req("r"))
    assert (d.prefill, d.cached_tokens, d.fetch_tokens, d.fetch_tier) == ("p0", 32, 0, "")


def test_another_workers_host_tier_is_not_loadable():
    c = make(host=1e9)
    c.blocks_stored("p1#host", KEYS[:8])  # only p1's own offload connector can load it
    c.place(req("first"))  # p0 (by name) now has a queue; p1 must win on its host tier, not by luck
    d = c.place(req("r"))
    assert (d.prefill, d.fetch_tier, d.cached_tokens) == ("p1", "host", 128)


def test_pool_disk_and_store_are_shared_and_priced_by_tier():
    c = make(pool_disk=1e8, store=1e6)
    c.blocks_stored("pool", KEYS[:3])
    c.blocks_stored("pool#pool_disk", KEYS[:8])
    c.blocks_stored("p1#store", KEYS[:9])  # a store put by p1: any worker loads it
    d = c.place(req("r"))
    # pool disk: 128 tokens at 100 MB/s = 1.28 ms + 32 computed; the store's 144 tokens at 1 MB/s = 144 ms
    assert (d.prefill, d.fetch_tier, d.cached_tokens) == ("p0", "pool_disk", 128)
    c.tier_costs.bandwidth["store"] = 1e10
    d = c.place(req("r2"))
    assert (d.fetch_tier, d.cached_tokens) == ("store", 144)


def test_tier_bandwidth_learned_from_loading_placements():
    clock = Clock()
    c = make(clock, host=1e8)
    c.blocks_stored("p0#host", KEYS[:8])
    d = c.place(req("r"))
    assert d.fetch_tier == "host"
    clock.t += 0.032 + 0.0128 + 0.5  # the prefill took half a second more than predicted: a slow load
    c.prefill_done("r")
    assert c.tier_costs.observations == {"host": 1}
    assert c.tier_costs.bandwidth["host"] < 1e8


def test_pool_memory_uses_the_measured_transfer_bandwidth():
    t = TierCosts(lambda n: n / 4e9, overhead_s=0.0)
    assert t.load_s("pool_memory", 4_000_000) == pytest.approx(1e-3)
    t.observe("pool_memory", 4_000_000, 1.0)  # learned by the cost model's transfers, not here
    assert t.observations == {}


def test_a_worker_that_leaves_takes_every_tier():
    c = make()
    for h in ("p0", "p0#host", "p0#disk", "p0#store"):
        c.blocks_stored(h, KEYS[:4])
    c.remove_worker("p0")
    assert c.index.prefix_lengths(KEYS) == {} and not c.store_holders


def test_flat_pricing_is_placement_before_tiers():
    """tier_pricing=flat: the pool's memory and disk count as one pool at the transfer price (1 GB/s here, the
    cost model's), a worker's own offload and the store are not starts."""
    c = make(pricing="flat", pool_disk=1e4, host=1e10, store=1e10)
    c.blocks_stored("pool", KEYS[:3])
    c.blocks_stored("pool#pool_disk", KEYS[:8])
    c.blocks_stored("p0#host", KEYS[:9])
    c.blocks_stored("p1#store", KEYS[:9])
    d = c.place(req("r"))
    # priced, the pool disk at 10 KB/s would not be worth loading; flat prices it as the pool's memory
    assert (d.prefill, d.fetch_tier, d.cached_tokens, d.fetch_tokens) == ("p0", "pool_memory", 128, 128)
    assert d.ttft_s == pytest.approx(128 * KV / 1e9 + 0.032)


def test_device_pricing_counts_only_device_hits():
    c = make(pricing="device", host=1e10, pool_disk=1e10, store=1e10)
    c.blocks_stored("p1", KEYS[:2])
    for h in ("pool", "pool#pool_disk", "p0#host", "p1#store"):
        c.blocks_stored(h, KEYS[:9])
    d = c.place(req("r"))
    assert (d.prefill, d.cached_tokens, d.fetch_tokens, d.fetch_tier) == ("p1", 32, 0, "")


def test_tier_pricing_is_checked():
    with pytest.raises(ValueError, match="tier_pricing.*priced, flat or device"):
        ConductorConfig(tier_pricing="none")


def test_a_pooled_chain_going_on_to_disk_counts_whole_at_each_blocks_price():
    """The pool's LRU spills a chain's later blocks first: its first blocks in memory, the rest on SSD only. The
    pool's connector loads the chain whole, so the start is all of it, each block at its own tier's price (before,
    only the memory-only part counted once the disk tier was logged)."""
    c = make(pool_disk=1e8)
    c.blocks_stored("pool", KEYS[:3])
    c.blocks_stored("pool#pool_disk", KEYS[3:8])
    d = c.place(req("r"))
    assert (d.cached_tokens, d.fetch_tokens, d.fetch_tier) == (128, 128, "pool_disk")
    assert d.ttft_s == pytest.approx(48 * KV / 1e9 + 80 * KV / 1e8 + 0.032)
    slow = make(pool_disk=1e3)  # an SSD too slow to be worth it: the memory part alone
    slow.blocks_stored("pool", KEYS[:3])
    slow.blocks_stored("pool#pool_disk", KEYS[3:8])
    d = slow.place(req("r"))
    assert (d.cached_tokens, d.fetch_tier) == (48, "pool_memory")
    flat = make(pricing="flat", pool_disk=1e3)  # before tiers: the whole pool at the memory's price
    flat.blocks_stored("pool", KEYS[:3])
    flat.blocks_stored("pool#pool_disk", KEYS[3:8])
    d = flat.place(req("r"))
    assert (d.cached_tokens, d.fetch_tier) == (128, "pool_memory")
