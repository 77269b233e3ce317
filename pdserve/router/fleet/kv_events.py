"""The router's KV event feed: one ZMQ SUB socket that **subscribes to every worker's publisher**, so any number
of router replicas each hear every worker.

Each worker's vLLM binds its publisher (``--kv-events-config {"endpoint": "ipc://..." | "tcp://*:PORT",
"replay_endpoint": ..., "topic": "<worker URL>"}``: vLLM binds for ``*``, ``::`` and ``ipc://``) and keeps its
last batches for replay. The router connects its SUB socket to a worker when the worker joins the registry
(:meth:`KVEventFeed.follow`) and disconnects when it leaves (:meth:`KVEventFeed.forget`). A replica that joins
later, a worker that restarts and a batch lost on the way are caught up through the worker's replay endpoint
(:mod:`.kv_replay`): the replica asks for the batches from the one it lacks (from 0 on joining), applies them
in order, then the live ones it held meanwhile, each sequence number once. When replay cannot fill the gap (the
worker's buffer no longer has it, or it has no replay endpoint) the clear-on-gap rule holds: that worker's
entries are dropped and re-learned from later events, so the index can under-state a worker's cache but never
claims blocks it no longer has.

The older layout still works: ``bind`` (``--kv-events-bind``) makes the same socket bind an endpoint that
workers' publishers connect to (one router only).

Frames are (topic, 8-byte big-endian sequence number, msgpack batch); see :mod:`pdserve.conductor.events`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from ...conductor.events import EventTranslator, IndexLike, StoredRun, decode_batch
from ...conductor.tiers import holder_of
from .kv_replay import replay

log = logging.getLogger("pdserve.router.fleet.kv_events")

Replayer = Callable[[zmq.asyncio.Context, str, int], Awaitable[list[tuple[int, bytes]] | None]]
Learner = Callable[[list[tuple[Hashable, int]]], None]
RunLearner = Callable[[list[StoredRun]], None]


@dataclass(frozen=True)
class Publisher:
    """Where one worker's vLLM publishes its KV events (``replay`` "" when it keeps none to replay)."""

    endpoint: str
    replay: str = ""


def default_publisher(url: str, port: int) -> Publisher | None:
    """A worker's publisher by convention (``--kv-events-port``): ``tcp://<its host>:PORT``, replay ``PORT + 1``;
    None when ``port`` is 0."""
    host = urlsplit(url).hostname
    if not port or not host:
        return None
    host = f"[{host}]" if ":" in host else host
    return Publisher(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}")


@dataclass
class _Stream:
    """One worker's event stream as this replica applies it."""

    translator: EventTranslator
    publisher: Publisher | None = None
    catching_up: asyncio.Task | None = None
    held: list[tuple[int, bytes]] = field(default_factory=list)  # live batches that arrived during a catch-up
    verify: tuple[int, bytes] | None = None  # resuming from a snapshot: (its last batch, that batch's digest)
    # batches applied from a replay whose live copies may still arrive (seq -> digest): the replay's answer and
    # the live stream are two sockets, so a batch published after the subscription took effect can come back by
    # replay first; its live copy is a duplicate, not a restarted publisher. Emptied by the next live batch
    # applied (a publisher's batches reach a subscriber in order).
    late: dict[int, bytes] = field(default_factory=dict)


def batch_digest(payload: bytes) -> bytes:
    """8 bytes that tell one batch's payload from another's (a snapshot's check that it resumes the same stream)."""
    return hashlib.blake2b(payload, digest_size=8).digest()


class KVEventFeed:
    def __init__(self, index: IndexLike, block_size: int, bind: str = "", replayer: Replayer = replay) -> None:
        self.index = index
        self.block_size = block_size
        self.replayer = replayer
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.IPV6, 1)  # workers on IPv6 addresses too
        self.endpoint = ""
        if bind:
            self.sock.bind(bind)
            self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.streams: dict[str, _Stream] = {}
        self.batches: dict[str, int] = {}
        self.skipped_blocks = 0
        self.bad_batches = 0
        self.duplicates = 0  # batches seen twice (replay overlapping live) and applied once
        self.replayed = 0  # batches applied from a replay
        self.clears = 0  # gaps replay could not fill: the worker's entries dropped
        # told (vLLM block hash, our key) of every block a worker stored, e.g. the Mooncake Store view, which sees
        # only vLLM's hashes in the store's keys (pdserve.router.fleet.mooncake_store)
        self.learners: list[Learner] = []
        # told every stored run with its tokens, e.g. the indexer's XXH3 map (pdserve.indexer.xxh3_keys)
        self.run_learners: list[RunLearner] = []
        self.task = asyncio.create_task(self._run())

    # ---- membership ----
    def follow(self, worker: str, publisher: Publisher) -> None:
        """Subscribe to ``worker``'s publisher and catch up from its first buffered batch."""
        worker = worker.rstrip("/")
        st = self._stream(worker)
        if st.publisher == publisher:
            return
        if st.publisher is not None:
            self._disconnect(st.publisher)
        st.publisher = publisher
        self.sock.connect(publisher.endpoint)
        log.info("KV events of %s: subscribed to %s (replay %s)", worker, publisher.endpoint,
                 publisher.replay or "none")
        if publisher.replay:
            self._catch_up(worker, st, 0)

    def resume(self, worker: str, publisher: Publisher, translator: EventTranslator, digest: bytes) -> None:
        """Follow ``worker`` from a snapshot: ``translator`` as of its batch ``translator.last_seq`` (whose payload
        had ``digest``). The catch-up asks the replay endpoint from that batch: when the worker still holds it,
        unchanged, the stream goes on from the next batch, none lost or applied twice; when it does not (its buffer
        moved on, or the worker restarted and numbers its batches anew), the worker's entries are dropped and
        re-learned from sequence 0 (the clear-on-gap rule)."""
        worker = worker.rstrip("/")
        st = self._stream(worker)
        if st.publisher is not None:
            self._disconnect(st.publisher)
        st.translator, st.publisher = translator, publisher
        self.sock.connect(publisher.endpoint)
        last = translator.last_seq
        if publisher.replay and last is not None:
            st.verify = (last, digest)
            self._catch_up(worker, st, last)
        elif last is not None:  # no replay: nothing can prove the stream is the same one
            self._clear(worker, translator)
            st.translator = EventTranslator(self.block_size)

    def forget(self, worker: str) -> None:
        st = self.streams.pop(worker.rstrip("/"), None)
        if st is None:
            return
        if st.catching_up is not None:
            st.catching_up.cancel()
        if st.publisher is not None:
            self._disconnect(st.publisher)

    def _disconnect(self, publisher: Publisher) -> None:
        try:
            self.sock.disconnect(publisher.endpoint)
        except zmq.ZMQError:  # never connected (or already gone)
            pass

    def _stream(self, worker: str) -> _Stream:
        st = self.streams.get(worker)
        if st is None:
            st = self.streams[worker] = _Stream(EventTranslator(self.block_size))
        return st

    # ---- the live stream ----
    async def _run(self) -> None:
        try:
            while True:
                self.handle(await self.sock.recv_multipart())
        except asyncio.CancelledError:
            pass
        except Exception:  # never let a bad publisher kill the router
            log.exception("KV event feed stopped")

    def handle(self, frames: list[bytes]) -> None:
        """One live batch: applied in order, held while its worker catches up, or the start of a catch-up when
        batches are missing."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_batches += 1
            return
        try:
            worker = frames[0].decode().rstrip("/")
        except UnicodeDecodeError:
            self.bad_batches += 1
            return
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        st = self._stream(worker)
        if st.catching_up is not None:
            st.held.append((seq, payload))
            return
        if st.late and st.late.get(seq) == batch_digest(payload):  # its replayed copy came first
            self.duplicates += 1
            return
        last = st.translator.last_seq
        expected = 0 if last is None else last + 1
        if seq != expected and st.publisher is not None and st.publisher.replay:
            # batches lost (seq > expected: on the way, or before this replica's subscription took effect while
            # its first replay found no worker yet) or a restarted publisher (seq < expected)
            st.held.append((seq, payload))
            self._catch_up(worker, st, last + 1 if last is not None and seq > last + 1 else 0)
            return
        st.late.clear()
        self._apply(worker, st, seq, payload)

    def _apply(self, worker: str, st: _Stream, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except ValueError:  # its events are unknown: the worker's entries cannot be trusted; go on from it
            log.info("KV events from %s: batch %d cannot be decoded; clearing its index entries", worker, seq)
            self.bad_batches += 1
            self.clears += 1
            self._clear(worker, st.translator)
            st.translator = EventTranslator(self.block_size)
            st.translator.last_seq, st.translator.last_digest = seq, batch_digest(payload)
            return
        if st.translator.sequence(seq):
            log.info("KV events from %s: gap or restart; clearing its index entries", worker)
            self.clears += 1
            self._clear(worker, st.translator)
        st.translator.last_digest = batch_digest(payload)
        up = st.translator.apply(events)
        self.batches[worker] = self.batches.get(worker, 0) + 1
        self.skipped_blocks += up.skipped
        up.apply_to(worker, self.index)
        if up.learned:
            for learn in self.learners:
                learn(up.learned)
        if up.runs:
            for learn_runs in self.run_learners:
                learn_runs(up.runs)

    def _clear(self, worker: str, translator: EventTranslator) -> None:
        """Drop ``worker``'s entries in every tier it published."""
        for tier in translator.held_tiers():
            self.index.all_cleared(holder_of(worker, tier))

    # ---- catching up through the worker's replay endpoint ----
    def _catch_up(self, worker: str, st: _Stream, start: int) -> None:
        assert st.publisher is not None
        st.catching_up = asyncio.create_task(self._replay_then_live(worker, st, st.publisher.replay, start))

    async def _replay_then_live(self, worker: str, st: _Stream, endpoint: str, start: int) -> None:
        got = await self.replayer(self.ctx, endpoint, start)
        if self.streams.get(worker) is not st:  # forgotten meanwhile
            return
        held, st.held, st.catching_up = st.held, [], None
        self.merge(worker, st, start, got or [], held)

    def merge(self, worker: str, st: _Stream, start: int, replayed: list[tuple[int, bytes]],
              held: list[tuple[int, bytes]]) -> None:
        """Apply what replay returned from ``start`` and then the live batches held meanwhile, each sequence number
        once and in order. Starting over (``start`` 0: a replica joining, a publisher restarted) or a replay
        that does not begin at ``start`` (the worker's buffer moved on) drops the worker's entries first. A
        resumed stream (:meth:`resume`) whose replay does not begin with the snapshot's own last batch starts
        over from 0; one whose replay does goes on from it, even when that batch is the worker's first (``start``
        0 is then the snapshot's point, not a fresh start: read as one, it cleared the restored entries)."""
        resumed = st.verify is not None  # from a snapshot's batch (start: that batch, 0 included)
        if st.verify is not None:
            want, st.verify = st.verify, None
            if not replayed or (replayed[0][0], batch_digest(replayed[0][1])) != want:
                log.info("KV events of %s: the snapshot's batch %d is gone or changed; re-learning", worker, want[0])
                self.clears += 1
                self._clear(worker, st.translator)
                st.translator = EventTranslator(self.block_size)
                st.held = held + st.held
                self._catch_up(worker, st, 0)
                return
        first = replayed[0][0] if replayed else (held[0][0] if held else start)
        if not resumed and (start == 0 or first != start):
            if st.translator.last_seq is not None or any(st.translator.tiers.values()):
                log.info("KV events of %s: replay from %d began at %s (held live batches from %s); clearing its "
                         "index entries", worker, start, first, held[0][0] if held else None)
                self.clears += 1
                self._clear(worker, st.translator)
            st.translator = EventTranslator(self.block_size)
        self.replayed += len(replayed)
        newest_held = max((seq for seq, _ in held), default=-1)
        st.late = {}
        batches = sorted([(seq, p, True) for seq, p in replayed] + [(seq, p, False) for seq, p in held],
                         key=lambda b: b[0])
        for i, (seq, payload, from_replay) in enumerate(batches):
            last = st.translator.last_seq
            if last is not None and seq <= last:
                self.duplicates += 1
                continue
            if last is not None and seq != last + 1:
                # batches published between the replay's answer and the subscription taking effect: neither
                # brought them; ask again from the first one missing (the rest wait as held batches)
                st.held = [(b[0], b[1]) for b in batches[i:]] + st.held
                self._catch_up(worker, st, last + 1)
                return
            self._apply(worker, st, seq, payload)
            if from_replay and seq > newest_held:
                st.late[seq] = st.translator.last_digest

    async def close(self) -> None:
        tasks = [self.task, *(s.catching_up for s in self.streams.values() if s.catching_up is not None)]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(0)
        self.ctx.term()
