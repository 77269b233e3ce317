"""Placeholders shared through the KV indexer: replica A's placement reaches replica B (A posts it to a real
indexer app, B reads the indexer's log) and B places the same prefix on the same prefill worker, with the
prefix counted as cached, before the worker's KV event; a replica without the indexer does not. In a replica's
index a placeholder ends when the worker's event confirms it (then it is the worker's truth) or its life ends
(then it is removed; a confirmed key stays)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
from pdserve.hashing import ROOT_KEY, block_hashes
from pdserve.indexer.app import create_app
from pdserve.indexer.service import IndexerConfig, IndexerService
from pdserve.router.fleet.placeholders import ExpectingIndex, PlaceholderSync
from pdserve.router.fleet.placement import ConductorPlacement
from pdserve.router.fleet.registry import WorkerRegistry

from .fake_clock import Clock

BS = 4
MEMBERS = (("prefill", "http://p0"), ("prefill", "http://p1"), ("decode", "http://d0"))


def replica(clock: Clock | None = None) -> ConductorPlacement:
    conductor = Conductor(ConductorConfig(policy="conductor", block_size=BS, local_prefill_tokens=0),
                          OnlineCostModel(1000), clock or Clock())
    return ConductorPlacement(conductor, WorkerRegistry(MEMBERS))


def test_a_placeholder_is_confirmed_or_expires():
    clock = Clock()
    cp = replica(clock)
    ix = ExpectingIndex(cp.conductor, ttl_s=10.0, clock=clock)
    held = cp.conductor.index
    ix.blocks_stored("http://p0", [1])
    assert ix.expect("http://p0", [1, 2, 3]) == 2  # 1 is held already: not a placeholder
    assert ix.expect("http://nobody", [5]) == 0
    assert {k for k in (1, 2, 3) if held.holds("http://p0", k)} == {1, 2, 3}
    ix.blocks_stored("http://p0", [2])  # the worker's event: 2 is its truth now
    clock.t += 10.5
    assert ix.expire() == 1 and ix.confirmed == 1
    assert {k for k in (1, 2, 3) if held.holds("http://p0", k)} == {1, 2}
    ix.expect("http://p1", [7])
    ix.all_cleared("http://p1")
    assert not ix.pending and not held.holds("http://p1", 7)


def test_replicas_see_each_others_placements_through_the_indexer():
    async def main() -> None:
        svc = IndexerService(IndexerConfig(block_size=BS))
        client = TestClient(TestServer(create_app(svc)))
        await client.start_server()
        url = str(client.make_url("")).rstrip("/")
        a, b, alone = replica(), replica(), replica()
        prompt = list(range(100, 140))
        keys = block_hashes(prompt, BS, ROOT_KEY)
        try:
            async with aiohttp.ClientSession() as session:
                syncs = []
                for cp in (a, b):
                    s = PlaceholderSync(url, session, ExpectingIndex(cp.conductor), poll_s=0.01)
                    cp.on_placed.append(s.placed)
                    s.start()
                    syncs.append(s)
                await asyncio.sleep(0.05)  # both read the (empty) log once
                first = a.choose(prompt, max_tokens=4).decision
                for _ in range(100):
                    await asyncio.sleep(0.01)
                    if syncs[1].applied:
                        break
                assert syncs[0].posted == 1 and syncs[1].applied == len(keys)
                assert syncs[0].applied == 0  # its own entry, read back, is skipped
                # the indexer holds it as a placeholder too (Mooncake-shaped lookup)
                async with session.post(url + "/query_by_hash", json={"seq_hashes": keys}) as r:
                    found = (await r.json())["default"]
                assert found[first.prefill]["placeholder"] == len(keys) * BS
                second = b.choose(prompt + [7, 7, 7, 7], max_tokens=4).decision
                assert second.prefill == first.prefill and second.cached_tokens == len(keys) * BS
                control = alone.choose(prompt, max_tokens=4).decision
                assert control.cached_tokens == 0
                async with session.get(url + "/expect", params={"since": "x"}) as r:
                    assert r.status == 400 and "since" in (await r.json())["error"]["message"]
                for s in syncs:
                    await s.close()
        finally:
            await client.close()

    asyncio.run(main())
