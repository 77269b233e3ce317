"""The router's KV event feed subscribing to worker publishers (real pyzmq sockets on 127.0.0.1, fake vLLM
publishers speaking vLLM's frames and replay protocol): two replicas see the same index, a replica that joins
late catches up by replay, a lost batch is filled by replay, duplicates apply once, a worker that leaves is
unsubscribed."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest
import zmq

from pdserve.router.fleet.kv_events import KVEventFeed, Publisher
from pdserve.router.fleet.kv_replay import END_SEQ

BS = 2
URL = "http://127.0.0.1:9001"


class Index:
    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}
        self.clears = 0

    def blocks_stored(self, holder: str, keys: list[int]) -> None:
        self.held.setdefault(holder, set()).update(keys)

    def blocks_removed(self, holder: str, keys: list[int]) -> None:
        self.held.get(holder, set()).difference_update(keys)

    def all_cleared(self, holder: str) -> None:
        self.clears += 1
        self.held.pop(holder, None)


def _stored(i: int, parent: int | None) -> bytes:
    ev = {"type": "BlockStored", "block_hashes": [i], "parent_block_hash": parent, "token_ids": [i, i + 1],
          "block_size": BS, "lora_name": None}
    return msgpack.packb([0.0, [ev], 0])


class FakePublisher:
    """vLLM's ZmqEventPublisher as the router sees it: PUB bound, ROUTER replay of every batch kept."""

    def __init__(self, topic: str = URL) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_sock = self.ctx.socket(zmq.ROUTER)
        rport = self.replay_sock.bind_to_random_port("tcp://127.0.0.1")
        self.publisher = Publisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        self.topic = topic.encode()
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replays = 0
        self.running = True
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, payload: bytes, send: bool = True) -> None:
        """One batch; ``send=False`` keeps it for replay only (as if lost on the way)."""
        self.buffer.append((self.seq, payload))
        if send:
            self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def _serve_replay(self) -> None:
        while self.running:
            if not self.replay_sock.poll(50):
                continue
            client, _, start = self.replay_sock.recv_multipart()
            self.replays += 1
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    self.replay_sock.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.replay_sock.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.pub.close(0)
        self.replay_sock.close(0)
        self.ctx.term()


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
def publisher():
    p = FakePublisher()
    yield p
    p.close()


def test_two_replicas_and_a_late_one_see_the_same_index(publisher):
    async def main() -> None:
        a, b = Index(), Index()
        fa, fb = KVEventFeed(a, BS), KVEventFeed(b, BS)
        fa.follow(URL, publisher.publisher)
        fb.follow(URL, publisher.publisher)
        await _until(lambda: publisher.replays == 2 and all(not s.catching_up for f in (fa, fb)
                                                               for s in f.streams.values()))
        await asyncio.sleep(0.2)  # the SUB connections are up
        parent = None
        for i in range(0, 10, 2):
            publisher.publish(_stored(i, parent))
            parent = i
        await _until(lambda: len(a.held.get(URL, ())) == 5 and len(b.held.get(URL, ())) == 5)
        assert a.held == b.held and a.clears == b.clears == 0
        late = Index()  # a replica started after the traffic: replay gives it everything
        fl = KVEventFeed(late, BS)
        fl.follow(URL, publisher.publisher)
        await _until(lambda: len(late.held.get(URL, ())) == 5)
        assert late.held == a.held and fl.replayed == 5
        for f in (fa, fb, fl):
            await f.close()

    asyncio.run(main())


def test_a_lost_batch_is_filled_by_replay_and_duplicates_apply_once(publisher):
    async def main() -> None:
        idx = Index()
        feed = KVEventFeed(idx, BS)
        feed.follow(URL, publisher.publisher)
        await _until(lambda: publisher.replays == 1 and not feed.streams[URL].catching_up)
        await asyncio.sleep(0.2)
        publisher.publish(_stored(0, None))
        await _until(lambda: len(idx.held.get(URL, ())) == 1)
        publisher.publish(_stored(2, 0), send=False)  # lost on the way; the publisher still holds it
        publisher.publish(_stored(4, 2))
        await _until(lambda: len(idx.held.get(URL, ())) == 3)
        assert idx.clears == 0 and publisher.replays == 2 and feed.duplicates == 1  # seq 2: live and replayed
        # replay overlapping what was already applied: each sequence number once
        st = feed.streams[URL]
        feed.merge(URL, st, 1, [(1, _stored(2, 0)), (2, _stored(4, 2))], [(2, _stored(4, 2))])
        assert feed.duplicates == 4 and idx.clears == 0 and len(idx.held[URL]) == 3
        await feed.close()

    asyncio.run(main())


def test_a_gap_replay_cannot_fill_clears_and_a_forgotten_worker_is_unsubscribed(publisher):
    async def main() -> None:
        idx = Index()
        feed = KVEventFeed(idx, BS)
        feed.follow(URL, Publisher(publisher.publisher.endpoint))  # no replay endpoint: clear-on-gap
        await asyncio.sleep(0.3)
        publisher.publish(_stored(0, None))
        await _until(lambda: len(idx.held.get(URL, ())) == 1)
        publisher.publish(_stored(2, 0), send=False)
        publisher.publish(_stored(4, 2))  # its parent was lost: cannot be keyed
        await _until(lambda: feed.batches[URL] == 2)
        assert idx.clears == 1 and not idx.held.get(URL) and feed.skipped_blocks == 1
        feed.forget(URL)
        publisher.publish(_stored(6, None))
        await asyncio.sleep(0.3)
        assert feed.batches[URL] == 2 and URL not in feed.streams
        await feed.close()

    asyncio.run(main())


def test_a_first_batch_past_zero_after_a_replay_found_no_worker_catches_up(publisher):
    from pdserve.router.fleet.kv_replay import replay

    calls = []

    async def not_up_the_first_time(ctx, endpoint: str, start: int):
        calls.append(start)
        return None if len(calls) == 1 else await replay(ctx, endpoint, start)

    async def main() -> None:
        idx = Index()
        feed = KVEventFeed(idx, BS, replayer=not_up_the_first_time)
        feed.follow(URL, publisher.publisher)
        await _until(lambda: not feed.streams[URL].catching_up)
        parent = None
        for i in range(0, 6, 2):  # published before the subscription took effect
            publisher.publish(_stored(i, parent), send=False)
            parent = i
        await asyncio.sleep(0.2)
        publisher.publish(_stored(6, 4))  # the first live batch is seq 3: 0..2 come by replay
        await _until(lambda: len(idx.held.get(URL, ())) == 4)
        assert calls == [0, 0] and idx.clears == 0 and feed.duplicates == 1
        await feed.close()

    asyncio.run(main())


def test_replay_that_no_longer_starts_where_asked_starts_over():
    idx = Index()

    async def main() -> None:
        feed = KVEventFeed(idx, BS, replayer=_no_replay)
        feed.follow(URL, Publisher("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
        st = feed.streams[URL]
        await _until(lambda: st.catching_up is None)
        feed.merge(URL, st, 0, [(0, _stored(0, None))], [])
        assert len(idx.held[URL]) == 1
        # asked from 5, the buffer begins at 7: entries dropped, rebuilt from what came back
        feed.merge(URL, st, 5, [(7, _stored(10, None)), (8, _stored(12, 10))], [(8, _stored(12, 10))])
        assert idx.clears == 1 and len(idx.held[URL]) == 2 and feed.duplicates == 1
        await feed.close()

    asyncio.run(main())


async def _no_replay(ctx, endpoint: str, start: int):
    return None


def test_a_worker_with_no_named_publisher_gets_the_port_convention():
    from pdserve.router.fleet.kv_events import default_publisher

    assert default_publisher("http://10.0.0.5:8000", 5557) == Publisher("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert default_publisher("http://[fd00::5]:8000", 5557) == Publisher("tcp://[fd00::5]:5557",
                                                                          "tcp://[fd00::5]:5558")
    assert default_publisher("http://10.0.0.5:8000", 0) is None
