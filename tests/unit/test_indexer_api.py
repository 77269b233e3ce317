"""The indexer's table and HTTP API: tiers from vLLM's media, lookups per owner and tier (and the longest prefix
over an owner's tiers together), placeholders that a worker's event confirms or that expire, Mooncake's
/register, /unregister, /query, /query_by_hash shapes, and JSON errors for bad input."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
from aiohttp.test_utils import TestClient, TestServer

from pdserve.conductor.events import EventTranslator
from pdserve.hashing import block_hashes
from pdserve.indexer.app import create_app
from pdserve.indexer.service import IndexerConfig, IndexerService
from pdserve.indexer.table import TieredIndex

BS = 4
W = "http://10.0.0.1:8000"


def _stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str | None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_name": None, "medium": medium}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_tiers_from_media_and_lookups():
    toks = list(range(16))
    keys = block_hashes(toks, BS)
    tr = EventTranslator(BS)
    table = TieredIndex(Clock())
    # 4 blocks on the device; blocks 0-1 offloaded to the host, block 3 to the worker's disk
    tr.apply([_stored([1, 2, 3, 4], None, toks, "GPU")]).apply_to(W, table)
    tr.apply([_stored([1, 2], None, toks[:8], "CPU"), _stored([4], 3, toks[12:], "STORAGE")]).apply_to(W, table)
    assert table.lookup(keys)[W] == {"device": 4, "host": 2, "longest": 4}
    # the device drops blocks 1-3 (vLLM evicts), the host keeps its copies: a removal names its medium
    tr.apply([{"type": "BlockRemoved", "block_hashes": [2, 3, 4], "medium": "GPU"}]).apply_to(W, table)
    assert table.lookup(keys)[W] == {"device": 1, "host": 2, "longest": 2}
    assert table.lookup(keys, tiers=["host"])[W] == {"host": 2, "longest": 2}
    assert table.blocks()[W] == {"device": 1, "host": 2, "disk": 1}
    # AllBlocksCleared empties every tier of the worker
    tr.apply([{"type": "AllBlocksCleared"}]).apply_to(W, table)
    assert table.lookup(keys) == {} and table.blocks() == {}


def test_longest_prefix_spans_tiers():
    toks = list(range(12))
    keys = block_hashes(toks, BS)
    table = TieredIndex(Clock())
    table.blocks_stored(W, keys[:1])
    table.blocks_stored(W + "#host", keys[1:3])
    got = table.lookup(keys)[W]
    assert got == {"device": 1, "longest": 3}  # the host's blocks 1-2 do not start the prompt on their own


def test_placeholders_confirmed_or_expired():
    clock = Clock()
    table = TieredIndex(clock, placeholder_ttl_s=5.0)
    keys = block_hashes(list(range(12)), BS)
    assert table.expect(W, keys) == 3
    assert table.lookup(keys)[W] == {"longest": 0, "placeholder": 3}
    table.blocks_stored(W, keys[:2])  # the worker's event: confirmed blocks leave the placeholders
    assert table.lookup(keys)[W] == {"device": 2, "longest": 2, "placeholder": 3}  # block 2 still expected
    clock.t = 5.0  # its life ends
    assert table.lookup(keys)[W] == {"device": 2, "longest": 2}
    assert table.placeholders.confirmed == 2 and table.placeholders.expired == 1 and len(table.placeholders) == 0


async def _client(tmp_path: Any) -> tuple[TestClient, IndexerService]:
    svc = IndexerService(IndexerConfig(block_size=BS, snapshot_path=str(tmp_path / "snap"), snapshot_interval_s=0))
    client = TestClient(TestServer(create_app(svc)))
    await client.start_server()
    return client, svc


def test_mooncake_api_shapes_and_errors(tmp_path):
    async def main() -> None:
        client, svc = await _client(tmp_path)
        try:
            r = await client.post("/register", json={"instance_id": W, "endpoint": "tcp://127.0.0.1:1",
                                                     "replay_endpoint": "", "type": "vLLM", "block_size": BS})
            assert r.status == 200 and (await r.json())["instance_id"] == W
            assert svc.feed is not None
            toks = list(range(10))  # two full blocks and a partial one
            ev = _stored([7, 8], None, toks[:8], None)
            svc.feed.handle([W.encode(), (0).to_bytes(8, "big"), msgpack.packb([0.0, [ev], 0])])
            r = await client.post("/query", json={"model": "m", "token_ids": toks, "block_size": BS})
            assert await r.json() == {"default": {W: {"longest_matched": 8, "device": 8}}}
            r = await client.post("/query_by_hash", json={"seq_hashes": block_hashes(toks, BS)[:1],
                                                          "instance_id": W, "tenant_id": "t"})
            assert await r.json() == {"t": {W: {"longest_matched": 4, "device": 4}}}
            view = await (await client.get("/global_view")).json()
            assert view["blocks"] == {W: {"device": 2}} and view["streams"][W]["last_seq"] == 0
            snap = await (await client.post("/snapshot")).json()
            assert snap["blocks"] == 2 and snap["bytes"] > 0
            for path, body, status in [
                ("/query", [1, 2], 400), ("/query", {"token_ids": [-1]}, 400), ("/query", {"token_ids": "x"}, 400),
                ("/query", {"token_ids": [1], "block_size": 16}, 400), ("/query_by_hash", {}, 400),
                ("/query_by_hash", {"seq_hashes": [1], "hash": "xxh3"}, 400),
                ("/register", {"instance_id": W, "endpoint": "http://x"}, 400), ("/register", {}, 400),
                ("/unregister", {"instance_id": "http://nobody"}, 404), ("/nope", {}, 404),
            ]:
                r = await client.post(path, json=body)
                assert r.status == status, (path, body, r.status)
                assert "message" in (await r.json())["error"]
            r = await client.post("/query", data=b"{not json")
            assert r.status == 400
            r = await client.post("/unregister", json={"instance_id": W})
            assert r.status == 200 and (await r.json())["removed_instances"] == [W]
            assert svc.table.blocks() == {}
        finally:
            await client.close()

    asyncio.run(main())
