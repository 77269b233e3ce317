"""Mooncake's XXH3 rolling sequence hashes on the indexer (issue 39; pdserve/indexer/xxh3_keys.py): the hashing
standard's byte layout, /query_by_hash with "hash": "xxh3" answering as /query does for the same tokens (key
domains, continuations, an unknown hash ending the prefix, another seed finding nothing), the map in snapshots, its
bound."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack
import pytest
import xxhash
from aiohttp.test_utils import TestClient, TestServer

from pdserve.conductor.events import StoredRun
from pdserve.hashing import block_hashes, domain_root
from pdserve.indexer.app import create_app
from pdserve.indexer.service import IndexerConfig, IndexerService
from pdserve.indexer.xxh3_keys import Xxh3Keys, chain, local_hash, seq_hashes

BS = 4
W = "http://10.0.0.1:8000"
SEED = 0x5EED


def test_the_hashing_standard_s_bytes():
    """Local hash: XXH3-64 of the block's tokens as little-endian u32; sequence hash i: XXH3-64 of (sequence hash
    i-1, local hash i) as little-endian u64; the first block's is its local hash; seeded alike."""
    toks = [1, 70000, 3, 2**32 - 1, 5, 6, 7, 8, 9, 10]  # two full blocks and a partial one
    l0 = xxhash.xxh3_64_intdigest(struct.pack("<4I", *toks[:4]), SEED)
    l1 = xxhash.xxh3_64_intdigest(struct.pack("<4I", *toks[4:8]), SEED)
    assert local_hash(toks[:4], SEED) == l0 and local_hash(toks[4:8], SEED) == l1
    s1 = xxhash.xxh3_64_intdigest(struct.pack("<QQ", l0, l1), SEED)
    assert chain(l0, l1, SEED) == s1
    assert seq_hashes(toks, BS, SEED) == [l0, s1]
    assert seq_hashes(toks[4:8], BS, SEED, prev=l0) == [s1]  # a continuation from its parent's hash
    assert seq_hashes(toks, BS) != seq_hashes(toks, BS, SEED)  # the seed changes every hash
    with pytest.raises(ValueError):
        seq_hashes(toks, 0)


def _stored(hashes: list[int], parent: int | None, tokens: list[int], lora: str | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_name": lora, "medium": None}


def _feed(svc: IndexerService, seq: int, events: list[dict[str, Any]]) -> None:
    assert svc.feed is not None
    svc.feed.handle([W.encode(), seq.to_bytes(8, "big"), msgpack.packb([0.0, events, 0])])


async def _client(svc: IndexerService) -> TestClient:
    client = TestClient(TestServer(create_app(svc)))
    await client.start_server()
    r = await client.post("/register", json={"instance_id": W, "endpoint": "tcp://127.0.0.1:1", "block_size": BS})
    assert r.status == 200
    return client


def _config(tmp_path: Any, **kw: Any) -> IndexerConfig:
    return IndexerConfig(block_size=BS, snapshot_path=str(tmp_path / "snap"), snapshot_interval_s=0, xxh3=True,
                         xxh3_seed=SEED, **kw)


TOKS = list(range(100, 116))  # four blocks: stored as a run of two, then a continuation of two


def test_query_by_xxh3_hash_answers_as_query_by_tokens(tmp_path):
    async def main() -> None:
        svc = IndexerService(_config(tmp_path))
        client = await _client(svc)
        try:
            _feed(svc, 0, [_stored([1, 2], None, TOKS[:8]), _stored([3, 4], 2, TOKS[8:16]),
                           _stored([9], None, TOKS[:4], lora="a1")])  # the first block again, under an adapter
            hashes = seq_hashes(TOKS, BS, SEED)
            by_tokens = await (await client.post("/query", json={"token_ids": TOKS, "block_size": BS})).json()
            r = await client.post("/query_by_hash", json={"seq_hashes": hashes, "hash": "xxh3"})
            assert r.status == 200 and await r.json() == by_tokens == {"default": {W: {"longest_matched": 16,
                                                                                       "device": 16}}}
            # an unknown hash ends the prefix; the older name block_hash is taken too
            r = await client.post("/query_by_hash", json={"block_hash": hashes[:2] + [12345] + hashes[3:],
                                                          "hash": "xxh3"})
            assert (await r.json())["default"][W]["longest_matched"] == 8
            # the adapter's domain holds its own first block only
            r = await client.post("/query_by_hash", json={"seq_hashes": hashes, "hash": "xxh3", "lora_name": "a1"})
            assert (await r.json())["default"][W]["longest_matched"] == 4
            # another seed's hashes find nothing
            r = await client.post("/query_by_hash", json={"seq_hashes": seq_hashes(TOKS, BS, 1), "hash": "xxh3"})
            assert await r.json() == {"default": {}}
            # pdserve's own keys still work as before
            r = await client.post("/query_by_hash", json={"seq_hashes": block_hashes(TOKS, BS)})
            assert (await r.json())["default"][W]["longest_matched"] == 16
            r = await client.post("/query_by_hash", json={"seq_hashes": hashes, "hash": "md5"})
            assert r.status == 400 and "xxh3" in (await r.json())["error"]["message"]
            view = await (await client.get("/global_view")).json()
            assert view["counters"]["xxh3_blocks"] == 5 and view["counters"]["xxh3_unchained"] == 0
            # the map survives a snapshot and a restart; with another seed the restart does not take it
            await svc.snapshot_now()
            again = IndexerService(_config(tmp_path))
            await again.start()
            assert again.xxh3 is not None and len(again.xxh3) == 5
            assert again.xxh3.keys(hashes, domain_root()) == block_hashes(TOKS, BS)
            await again.close(final_snapshot=False)
            other = IndexerService(IndexerConfig(block_size=BS, snapshot_path=str(tmp_path / "snap"),
                                                 snapshot_interval_s=0, xxh3=True, xxh3_seed=7))
            await other.start()
            assert other.xxh3 is not None and len(other.xxh3) == 0
            await other.close(final_snapshot=False)
        finally:
            await client.close()
            await svc.close(final_snapshot=False)

    asyncio.run(main())


def test_without_the_map_xxh3_is_a_clear_400(tmp_path):
    async def main() -> None:
        svc = IndexerService(IndexerConfig(block_size=BS))
        client = await _client(svc)
        try:
            r = await client.post("/query_by_hash", json={"seq_hashes": [1], "hash": "xxh3"})
            assert r.status == 400 and "--xxh3" in (await r.json())["error"]["message"]
        finally:
            await client.close()
            await svc.close(final_snapshot=False)

    asyncio.run(main())


def test_the_map_is_bounded_and_skips_runs_whose_parent_it_never_learned():
    m = Xxh3Keys(BS, SEED, max_blocks=2)
    keys = block_hashes(TOKS, BS)
    m.learn([StoredRun(domain_root(), True, keys[:2], TOKS[:8])])
    m.learn([StoredRun(12345, False, keys[2:3], TOKS[8:12])])  # a parent never seen: not mapped
    assert m.unchained == 1 and len(m) == 2
    m.learn([StoredRun(keys[1], False, keys[2:4], TOKS[8:16])])
    assert len(m) == 2  # the oldest two went
    hashes = seq_hashes(TOKS, BS, SEED)
    assert m.keys(hashes, domain_root()) == [] and m.keys(hashes[2:], domain_root()) == keys[2:]
    with pytest.raises(ValueError):
        Xxh3Keys(BS, -1)
