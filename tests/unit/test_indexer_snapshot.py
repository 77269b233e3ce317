"""The indexer's snapshots resume each worker's stream exactly: restored from a snapshot taken after batch k and
fed the worker's replay from there plus the live batches, its table equals that of an indexer that never stopped
(none lost, none applied twice), also when the worker's buffer no longer holds the batches before k (a fresh
indexer then under-states, by the clear-on-gap rule); a worker that restarted meanwhile is re-learned from its new
stream. The streams are vLLM-shaped batches over two media (device and host offload)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgpack

from pdserve.indexer import snapshot
from pdserve.indexer.service import IndexerConfig, IndexerService
from pdserve.router.fleet.kv_events import Publisher

BS = 4
URL = "http://127.0.0.1:9001"
PUB = Publisher("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")  # never dialled: the replayer below answers


def stream(n: int, seed: int) -> list[bytes]:
    """n batches: new chains on the device, copies to the host offload, removals from either."""
    rng = random.Random(seed)
    blocks: dict[int, tuple[int | None, list[int]]] = {}  # vLLM hash -> (parent, tokens)
    on: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    out = []
    nxt = seed * 1_000_000
    for _ in range(n):
        events: list[dict[str, Any]] = []
        for _ in range(rng.randrange(1, 4)):
            r = rng.random()
            if r < 0.55 or not on["GPU"]:
                parent = rng.choice(sorted(on["GPU"])) if on["GPU"] and rng.random() < 0.6 else None
                hashes, toks = [], []
                for _ in range(rng.randrange(1, 4)):
                    nxt += 1
                    t = [rng.randrange(50_000) for _ in range(BS)]
                    blocks[nxt] = (parent if not hashes else hashes[-1], t)
                    hashes.append(nxt)
                    toks += t
                on["GPU"].update(hashes)
                events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                               "token_ids": toks, "block_size": BS, "lora_name": None, "medium": "GPU"})
            elif r < 0.75:
                h = rng.choice(sorted(on["GPU"]))
                parent, t = blocks[h]
                if parent is None or parent in on["GPU"] or parent in on["CPU"]:
                    on["CPU"].add(h)
                    events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                                   "token_ids": t, "block_size": BS, "lora_name": None, "medium": "CPU"})
            else:
                medium = "CPU" if on["CPU"] and rng.random() < 0.4 else "GPU"
                gone = rng.sample(sorted(on[medium]), min(len(on[medium]), rng.randrange(1, 3)))
                on[medium].difference_update(gone)
                events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": medium})
        out.append(msgpack.packb([0.0, events, 0]))
    return out


class Worker:
    """A publisher's replay buffer: batches ``first..`` of ``payloads``."""

    def __init__(self, payloads: list[bytes], first: int = 0) -> None:
        self.payloads, self.first, self.asked = payloads, first, []

    async def replay(self, ctx: Any, endpoint: str, start: int) -> list[tuple[int, bytes]]:
        self.asked.append(start)
        return [(s, p) for s, p in enumerate(self.payloads) if s >= max(start, self.first)]


def view(svc: IndexerService) -> dict[str, set[int]]:
    ix = svc.table.index
    return {h: set(ix.keys_of(h)) for h in ix.holders() if ix.keys_of(h)}


async def _run(svc: IndexerService, payloads: list[bytes], first: int, last: int) -> None:
    """Start ``svc`` (restoring its snapshot, if any) and feed it the live batches first..last-1."""
    await svc.start()
    assert svc.feed is not None
    if not svc.config.snapshot_path or not svc.feed.streams:
        svc.register(URL, PUB)
    for seq in range(first, last):
        svc.feed.handle([URL.encode(), seq.to_bytes(8, "big"), payloads[seq]])
        if seq == first:
            await asyncio.sleep(0)  # the catch-up's replay runs while live batches arrive: they are held
    for _ in range(50):
        await asyncio.sleep(0)
        if not any(st.catching_up for st in svc.feed.streams.values()):
            break


def _service(tmp_path, worker: Worker, name: str = "snap") -> IndexerService:
    return IndexerService(IndexerConfig(block_size=BS, snapshot_path=str(tmp_path / name),
                                        snapshot_interval_s=0), replayer=worker.replay)


def test_snapshot_resume_is_exact_even_when_the_buffer_moved_on(tmp_path):
    async def main() -> None:
        payloads = stream(400, 1)
        # the indexer that never stopped
        ref = _service(tmp_path, Worker(payloads[:1]), "ref")
        await _run(ref, payloads, 1, 400)
        # one that snapshots after batch 249 and is killed (no final snapshot)
        a = _service(tmp_path, Worker(payloads[:1]))  # its replay on joining has batch 0 only
        await _run(a, payloads, 1, 250)
        stats = await a.snapshot_now()
        assert stats.blocks == a.table.entries() > len(a.table.index) and stats.bytes > 0
        await a.close(final_snapshot=False)
        # restarted: the worker's buffer now holds only batches 200.. (as vLLM's bounded buffer would)
        worker = Worker(payloads[:300], first=200)  # published up to 299 by the time it is asked
        b = _service(tmp_path, worker)
        await _run(b, payloads, 300, 400)  # batches 250..299 arrive only through replay
        assert worker.asked == [249]  # resumed from the snapshot's own last batch, not from 0
        assert b.feed is not None and b.feed.clears == 0 and b.feed.duplicates >= 1
        assert view(b) == view(ref)
        assert any(h.endswith("#host") for h in view(b))  # two tiers, both restored
        await b.close(final_snapshot=False)
        # without the snapshot the same restart cannot rebuild the batches before 200: it under-states
        fresh = IndexerService(IndexerConfig(block_size=BS), replayer=Worker(payloads[:300], first=200).replay)
        await _run(fresh, payloads, 300, 400)
        assert view(fresh) != view(ref)
        assert all(view(fresh).get(h, set()) <= keys for h, keys in view(ref).items())
        await ref.close(final_snapshot=False)
        await fresh.close(final_snapshot=False)

    asyncio.run(main())


def test_a_snapshot_taken_after_the_workers_first_batch_resumes_from_it(tmp_path):
    """The snapshot's point is batch 0 (the worker published one batch while the indexer ran): the restart's
    replay from 0 is that point, proved by its digest, not a fresh start; nothing is cleared (a fresh-clone CI run
    and the shared-stack integration run cleared such a worker's restored entries)."""
    async def main() -> None:
        payloads = stream(40, 1)
        a = _service(tmp_path, Worker(payloads[:1]))
        await _run(a, payloads, 1, 1)  # batch 0 only, by the joining replay
        await a.snapshot_now()
        await a.close(final_snapshot=False)
        worker = Worker(payloads[:20])
        b = _service(tmp_path, worker)
        await _run(b, payloads, 20, 40)
        assert worker.asked == [0]
        assert b.feed is not None and b.feed.clears == 0, b.feed.clears
        ref = _service(tmp_path, Worker(payloads[:1]), "ref")
        await _run(ref, payloads, 1, 40)
        assert view(b) == view(ref)
        for svc in (b, ref):
            await svc.close(final_snapshot=False)

    asyncio.run(main())


def test_a_worker_restarted_since_the_snapshot_is_relearned(tmp_path):
    async def main() -> None:
        old, new = stream(120, 2), stream(80, 3)
        a = _service(tmp_path, Worker(old[:1]))
        await _run(a, old, 1, 120)
        await a.close()  # the final snapshot, after batch 119
        b = _service(tmp_path, Worker(new[:60]))  # the worker restarted: a new stream numbered from 0
        await _run(b, new, 60, 80)
        ref = IndexerService(IndexerConfig(block_size=BS), replayer=Worker(new[:60]).replay)
        await _run(ref, new, 60, 80)
        assert b.feed is not None and b.feed.clears == 1
        assert view(b) == view(ref)
        await b.close(final_snapshot=False)
        await ref.close(final_snapshot=False)

    asyncio.run(main())


def test_snapshot_file_round_trips_hash_kinds(tmp_path):
    for hashes in ([1, 2, (1 << 64) - 1], [b"a" * 32, b"b" * 32], [b"a", 7]):
        assert snapshot.unpack_hashes(snapshot.pack_hashes(list(hashes))) == list(hashes)
    doc = snapshot.document([], None)
    assert snapshot.write(tmp_path / "s", doc) > 0
    assert snapshot.read(tmp_path / "s") == {**doc, "taken_at": doc["taken_at"]}
    assert snapshot.read(tmp_path / "missing") is None
    (tmp_path / "bad").write_bytes(b"\x00garbage")
    try:
        snapshot.read(tmp_path / "bad")
    except ValueError as e:
        assert "not an indexer snapshot" in str(e)
    else:
        raise AssertionError("a garbage file was read as a snapshot")


def test_a_router_seeded_from_the_indexer_knows_what_the_replay_buffer_forgot(tmp_path):
    """A router that starts late (the worker's buffer holds only batches 200..) seeds its index from the indexer's
    GET /snapshot and resumes from there: it then holds what the indexer holds, where the replay alone could not."""
    import aiohttp
    from aiohttp.test_utils import TestClient, TestServer

    from pdserve.indexer.app import create_app
    from pdserve.indexer.table import TieredIndex
    from pdserve.router.fleet.index_seed import seed_from_indexer
    from pdserve.router.fleet.kv_events import KVEventFeed

    async def main() -> None:
        payloads = stream(300, 4)
        svc = IndexerService(IndexerConfig(block_size=BS), replayer=Worker(payloads[:1]).replay)
        client = TestClient(TestServer(create_app(svc)))
        await client.start_server()  # starts the service
        try:
            svc.register(URL, PUB)
            await asyncio.sleep(0.01)
            assert svc.feed is not None
            for seq in range(1, 300):
                svc.feed.handle([URL.encode(), seq.to_bytes(8, "big"), payloads[seq]])
            worker = Worker(payloads, first=200)
            table = TieredIndex(lambda: 0.0)
            feed = KVEventFeed(table, BS, replayer=worker.replay)
            async with aiohttp.ClientSession() as session:
                n = await seed_from_indexer(session, str(client.make_url("")), feed, table, {URL: PUB})
                assert n == svc.table.entries() > 0
                assert await seed_from_indexer(session, "http://127.0.0.1:1", feed, table, {URL: PUB}) == 0
            feed.follow(URL, PUB)  # what the router does next for every registered worker: a no-op here
            for _ in range(20):
                await asyncio.sleep(0)
            assert worker.asked == [299] and feed.clears == 0
            ix = table.index
            assert {h: set(ix.keys_of(h)) for h in ix.holders() if ix.keys_of(h)} == view(svc)
            await feed.close()
        finally:
            await client.close()

    asyncio.run(main())


def test_a_damaged_snapshot_starts_from_the_workers(tmp_path):
    async def main() -> None:
        (tmp_path / "snap").write_bytes(b"\x00not a snapshot")
        payloads = stream(30, 5)
        svc = _service(tmp_path, Worker(payloads[:1]))
        await _run(svc, payloads, 1, 30)
        assert svc.feed is not None and svc.feed.streams[URL].translator.last_seq == 29
        await svc.close(final_snapshot=False)

    asyncio.run(main())


def test_the_pool_log_resumes_from_the_snapshot_position(tmp_path):
    """The pool master's event log: a snapshot keeps its epoch, position and the pooled keys; a restart resumes
    the log from there under the same epoch (each event once), and resyncs when the master restarted."""
    from pdserve.conductor.tiers import POOL
    from pdserve.router.fleet.pool_index import DISK_HOLDER, PoolIndexFollower
    from tests.unit.test_router_pool_index import FakeMaster

    def follower(master: FakeMaster, svc: IndexerService) -> PoolIndexFollower:
        f = PoolIndexFollower.__new__(PoolIndexFollower)
        f.rpc, f.conductor, f.epoch, f.since = master, svc.table, None, 0
        f.applied, f.resyncs, f.reachable = 0, 0, False
        return f

    async def main() -> None:
        m = FakeMaster()
        for k in (1, 2, 3):
            m.do("stored", k)
        a = IndexerService(IndexerConfig(block_size=BS))
        await a.start()
        a.pool = follower(m, a)
        a.pool.poll_once()  # first contact: resync
        m.do("removed", 2)
        m.do("spilled", 3)  # on a node's SSD only: the pool's disk tier
        a.pool.poll_once()
        doc = a.capture()
        assert doc["pool"]["epoch"] == "e1" and sorted(snapshot.pool_keys(doc["pool"])) == [1]
        assert snapshot.pool_disk_keys(doc["pool"]) == [3]
        a.pool = None  # a scripted follower: no polling task to stop
        await a.close(final_snapshot=False)
        m.do("stored", 4)  # while the indexer is down
        m.do("removed", 1)
        b = IndexerService(IndexerConfig(block_size=BS))  # what start() does with a snapshot, minus the RPC client
        b.table.blocks_stored(POOL, snapshot.pool_keys(doc["pool"]))
        b.table.blocks_stored(DISK_HOLDER, snapshot.pool_disk_keys(doc["pool"]))
        f = follower(m, b)
        b.resume_pool(f, doc)
        f.poll_once()
        assert f.resyncs == 0 and sorted(b.table.index.keys_of(POOL)) == [4]
        assert b.table.index.keys_of(DISK_HOLDER) == {3}
        m.epoch = "e2"  # the master restarted: the next poll resyncs from its keys
        f.poll_once()
        assert f.resyncs == 1 and b.table.index.keys_of(POOL) == m.keys - m.disk
        assert b.table.index.keys_of(DISK_HOLDER) == m.disk == {3}

    asyncio.run(main())


class LiveWorker:
    """A publisher whose replay answers with what it has published by the time it is asked (``published``)."""

    def __init__(self, payloads: list[bytes], published: int) -> None:
        self.payloads, self.published, self.asked = payloads, published, []
        self.answer_after: asyncio.Event | None = None  # set: the answer reaches the indexer only then

    async def replay(self, ctx: Any, endpoint: str, start: int) -> list[tuple[int, bytes]]:
        self.asked.append(start)
        got = [(s, self.payloads[s]) for s in range(start, self.published)]
        if self.answer_after is not None:
            await self.answer_after.wait()
        return got


async def _settle(svc: IndexerService) -> None:
    assert svc.feed is not None
    for _ in range(50):
        await asyncio.sleep(0)
        if not any(st.catching_up for st in svc.feed.streams.values()):
            return


async def _snapshot_after(tmp_path, payloads: list[bytes], k: int) -> None:
    """An indexer that applies batches 0..k, snapshots and is killed (no final snapshot)."""
    a = _service(tmp_path, Worker(payloads[:1]))
    await _run(a, payloads, 1, k + 1)
    await a.snapshot_now()
    await a.close(final_snapshot=False)


async def _reference(tmp_path, payloads: list[bytes]) -> IndexerService:
    ref = _service(tmp_path, Worker(payloads[:1]), "ref")
    await _run(ref, payloads, 1, len(payloads))
    return ref


def test_a_live_copy_arriving_after_its_replayed_copy_is_a_duplicate_not_a_restart(tmp_path):
    """The integration test's race (one stream cleared after kill -9: replayed 16, duplicates 2, clears 1): the
    restarted indexer's replay answers with batches 40..45, of which 44 and 45 were published after its
    subscription took effect; their live copies reach the event loop after the replay's (two sockets). Read as
    a sequence number going back, they restarted the stream from 0 and cleared the worker."""
    async def main() -> None:
        payloads = stream(60, 7)
        ref = await _reference(tmp_path, payloads)
        await _snapshot_after(tmp_path, payloads, 40)
        worker = LiveWorker(payloads, published=46)
        b = _service(tmp_path, worker)
        await b.start()
        await _settle(b)  # the replay 40..45 is applied before any live batch is read
        assert b.feed is not None
        for seq in range(44, 60):  # the live copies of 44 and 45, then the stream goes on
            b.feed.handle([URL.encode(), seq.to_bytes(8, "big"), payloads[seq]])
        await _settle(b)
        assert worker.asked == [40]
        assert (b.feed.clears, b.feed.replayed, b.feed.duplicates) == (0, 6, 3), b.counters()
        assert view(b) == view(ref)
        await b.close(final_snapshot=False)
        await ref.close(final_snapshot=False)
        # the same seq with another payload is a restarted publisher (its stream anew), not a duplicate
        c = _service(tmp_path, worker := LiveWorker(payloads, published=46))
        await c.start()
        await _settle(c)
        new = stream(50, 8)
        worker.payloads, worker.published = new, 44
        assert c.feed is not None
        c.feed.handle([URL.encode(), (43).to_bytes(8, "big"), new[43]])
        await _settle(c)
        assert worker.asked == [40, 0] and c.feed.clears == 1
        fresh = IndexerService(IndexerConfig(block_size=BS), replayer=LiveWorker(new, 44).replay)
        await fresh.start()
        fresh.register(URL, PUB)
        await _settle(fresh)
        assert view(c) == view(fresh)
        await c.close(final_snapshot=False)
        await fresh.close(final_snapshot=False)

    asyncio.run(main())


def test_batches_published_between_the_replay_and_the_subscription_are_asked_for_again(tmp_path):
    """The other side of the same race: the replay answers before the subscription takes effect, so batches 46
    and 47 come neither by replay nor live; the first live batch held is 48. Applied as it stood, 48 after 45
    was a gap and cleared the worker; the feed asks the replay again from 46."""
    async def main() -> None:
        payloads = stream(60, 9)
        ref = await _reference(tmp_path, payloads)
        await _snapshot_after(tmp_path, payloads, 40)
        worker = LiveWorker(payloads, published=46)
        worker.answer_after = answered = asyncio.Event()
        b = _service(tmp_path, worker)
        await b.start()
        await asyncio.sleep(0)  # the replay is asked (40..45) ...
        assert b.feed is not None and worker.asked == [40]
        worker.published = 48  # ... 46, 47 are published while the subscription is on its way ...
        for seq in range(48, 52):  # ... and 48.. arrive live, held while the replay's answer travels
            b.feed.handle([URL.encode(), seq.to_bytes(8, "big"), payloads[seq]])
        worker.published, worker.answer_after = 52, None
        answered.set()
        await _settle(b)
        for seq in range(52, 60):
            b.feed.handle([URL.encode(), seq.to_bytes(8, "big"), payloads[seq]])
        await _settle(b)
        assert worker.asked == [40, 46]
        assert b.feed.clears == 0, b.counters()
        assert view(b) == view(ref)
        await b.close(final_snapshot=False)
        await ref.close(final_snapshot=False)

    asyncio.run(main())
