"""The router's view of Mooncake Store (pdserve/router/fleet/mooncake_store.py): the store's keys (vLLM's block
hashes) resolved through the workers' KV events into pdserve keys, kept in the conductor's index under the pool's
holder. The store's master is replaced by a scripted listing; the key format is vLLM MooncakeStoreConnector's."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
from pdserve.conductor.events import EventTranslator
from pdserve.hashing import block_key, domain_root
from pdserve.router.app import ROUTER_KEY
from pdserve.router.config import RouterConfig, RouterConfigError
from pdserve.router.fleet.mooncake_store import (
    HOLDER,
    MooncakeStoreFollower,
    StoreView,
    hash64,
    key_prefix,
    parse_listing,
)
from tests.unit.test_router_app import Env, FakeWorker, model_dir, tokenizer  # noqa: F401

BS = 4
PREFIX = key_prefix("/models/smol/")


def _digest(i: int) -> bytes:
    return bytes([i]) * 24 + (0x1000 + i).to_bytes(8, "big")  # a 32-byte sha256-like digest


def _store_key(i: int, prefix: str = PREFIX) -> str:
    return prefix + _digest(i).hex()


class Index:
    def __init__(self) -> None:
        self.keys: dict[str, set[int]] = {}
        self.log: list[tuple[str, list[int]]] = []

    def blocks_stored(self, holder: str, keys: list[int]) -> None:
        self.keys.setdefault(holder, set()).update(keys)
        self.log.append(("stored", list(keys)))

    def blocks_removed(self, holder: str, keys: list[int]) -> None:
        self.keys.setdefault(holder, set()).difference_update(keys)
        self.log.append(("removed", list(keys)))

    def all_cleared(self, holder: str) -> None:
        self.keys[holder] = set()
        self.log.append(("cleared", []))


def test_key_prefix_and_listing_keep_rank0_group0_of_this_model_only():
    assert PREFIX == "smol@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
    listing = "\n".join([
        _store_key(1),
        _store_key(2, "smol@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@"),  # another rank's shard
        _store_key(3, "other@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"),  # another model
        PREFIX + "not-hex",
        "",
    ])
    assert parse_listing(listing, PREFIX) == {0x1001}


def test_hash64_reads_events_int_and_bytes_hashes_as_the_store_key_suffix():
    assert hash64(_digest(7)) == 0x1007 == int(_store_key(7)[-16:], 16)
    assert hash64(0x1007) == 0x1007 and hash64((1 << 70) | 5) == 5
    assert hash64("x") is None and hash64(b"short") is None


def test_learned_then_listed_is_counted_and_removed_when_gone():
    idx = Index()
    v = StoreView(idx)
    v.learn([(0x1001, 111), (_digest(2), 222), (0x1003, 333)])
    assert idx.keys == {}  # learned, not pooled yet
    assert v.listing({0x1001, 0x1002, 0x9999}) == (2, 0)
    assert idx.keys[HOLDER] == {111, 222} and v.unresolved == 1  # 0x9999: never learned, not counted
    assert v.listing({0x1001, 0x1002, 0x9999}) == (0, 0)  # unchanged: nothing re-applied
    assert v.listing({0x1002, 0x1003}) == (1, 1)
    assert idx.keys[HOLDER] == {222, 333}
    v.clear()
    assert idx.keys[HOLDER] == set() and v.counted == {}
    assert v.listing({0x1002}) == (1, 0)  # the pairs stay learned across a master outage
    assert idx.keys[HOLDER] == {222}


def test_listed_then_learned_is_counted_on_learning():
    idx = Index()
    v = StoreView(idx)
    v.listing({0x1005})
    assert idx.keys == {} and v.unresolved == 1
    v.learn([(0x1005, 555)])
    assert idx.keys[HOLDER] == {555} and v.unresolved == 0
    v.learn([(0x1005, 555)])  # heard again: counted once
    assert idx.log == [("stored", [555])]


def test_known_pairs_are_bounded_oldest_first():
    v = StoreView(Index(), known_limit=2)
    v.learn([(1, 10), (2, 20)])
    v.learn([(1, 10)])  # refreshed
    v.learn([(3, 30)])
    assert list(v.known) == [1, 3]


def test_event_translator_reports_the_hash_key_pairs_it_keyed():
    t = EventTranslator(BS)
    tokens = list(range(8))
    batch = [{"type": "BlockStored", "block_hashes": [0xA1, 0xA2], "parent_block_hash": None,
              "token_ids": tokens, "block_size": BS}]
    up = t.apply(batch)
    k1 = block_key(domain_root(None, None), tokens[:4])
    k2 = block_key(k1, tokens[4:])
    assert up.stored == [k1, k2] and up.learned == [(0xA1, k1), (0xA2, k2)]


def test_conductor_counts_store_blocks_as_the_pool_holder():
    """Through the real conductor: a prompt whose blocks sit in the store has a pooled prefix."""
    c = Conductor(ConductorConfig(block_size=BS), OnlineCostModel(1))
    v = StoreView(c)
    tokens = list(range(100, 112))
    keys, parent = [], domain_root(None, None)
    for i in range(3):
        parent = block_key(parent, tokens[i * BS:(i + 1) * BS])
        keys.append(parent)
    v.learn([(0x10 + i, k) for i, k in enumerate(keys)])
    v.listing({0x10, 0x11})  # the first two blocks pooled
    assert c.index.prefix_lengths(keys)[HOLDER] == 2


def test_follower_polls_the_listing_and_forgets_the_store_while_the_master_is_down():
    async def run() -> None:
        idx = Index()
        state = {"keys": [_store_key(1)], "down": False}

        def fetch() -> str:
            if state["down"]:
                raise OSError("connection refused")
            return "\n".join(state["keys"]) + "\n"

        f = MooncakeStoreFollower("127.0.0.1:1", "/models/smol", idx, interval_s=0.01, fetch=fetch)
        try:
            f.learn([(_digest(1), 11), (_digest(2), 22)])
            for _ in range(200):
                if idx.keys.get(HOLDER) == {11}:
                    break
                await asyncio.sleep(0.01)
            assert idx.keys[HOLDER] == {11} and f.reachable
            state["keys"] = [_store_key(1), _store_key(2)]
            for _ in range(200):
                if idx.keys.get(HOLDER) == {11, 22}:
                    break
                await asyncio.sleep(0.01)
            assert idx.keys[HOLDER] == {11, 22}
            state["down"] = True
            for _ in range(200):
                if not f.reachable:
                    break
                await asyncio.sleep(0.01)
            assert not f.reachable and idx.keys[HOLDER] == set()
            state["down"] = False
            for _ in range(200):
                if idx.keys.get(HOLDER) == {11, 22}:
                    break
                await asyncio.sleep(0.01)
            assert f.reachable and idx.keys[HOLDER] == {11, 22}
        finally:
            await f.close()

    asyncio.run(run())


def test_router_refuses_a_bad_mooncake_store_address(model_dir):  # noqa: F811
    with pytest.raises(RouterConfigError, match="--mooncake-store"):
        RouterConfig(model_dir=str(model_dir), prefill=("http://a:1",), decode=("http://b:2",),
                     mooncake_store="no-port")


def test_router_counts_store_blocks_a_worker_stored(model_dir, tokenizer):  # noqa: F811
    """The router app's wiring: a worker's BlockStored (through the KV event feed) and the store's listing (over
    HTTP, as the master's admin server answers it) make the conductor's pool holder, seen on /metrics."""
    from aiohttp import web

    async def run() -> None:
        tokens = list(range(300, 300 + 2 * 128))
        keys = {"text": ""}

        async def all_keys(_: web.Request) -> web.Response:
            return web.Response(text=keys["text"])

        app = web.Application()
        app.router.add_get("/get_all_keys", all_keys)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with Env(model_dir, tokenizer, prefill=[FakeWorker("p")], decode=[FakeWorker("d")], policy="conductor",
                           calibrate=False, mooncake_store=f"127.0.0.1:{port}") as env:
                router = env.app[ROUTER_KEY]
                assert isinstance(router.pool, MooncakeStoreFollower) and router.events is not None
                batch = [0.0, [{"type": "BlockStored", "block_hashes": [0x1001, 0x1002], "parent_block_hash": None,
                                "token_ids": tokens, "block_size": 128}], None]
                router.events.handle([env.prefill[0].url.encode(), (0).to_bytes(8, "big"), msgpack.packb(batch)])
                keys["text"] = "\n".join(_store_key(i, key_prefix(str(model_dir))) for i in (1, 2)) + "\n"
                want = 'pdserve_conductor_indexed_blocks{holder="pool"} 2.0'
                text = ""
                for _ in range(100):
                    async with env.session.get(env.url + "/metrics") as r:
                        text = await r.text()
                    if want in text:
                        break
                    await asyncio.sleep(0.05)
                assert want in text, [ln for ln in text.splitlines() if "indexed_blocks" in ln]
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_msgpack_int_hashes_survive_the_wire():
    """vLLM publishes int hashes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): up to 64 bits through msgpack."""
    h = (1 << 64) - 3
    assert hash64(msgpack.unpackb(msgpack.packb(h))) == h
