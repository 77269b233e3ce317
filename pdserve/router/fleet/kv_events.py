"""The router's KV event sink: one ZMQ SUB socket the router binds; every worker's vLLM publisher connects to
it (``--kv-events-config {"endpoint": "tcp://ROUTER:PORT", "topic": "<worker URL>"}``: vLLM connects when the
endpoint names a host, binds only for ``*``). The topic says which worker an event batch is from, so workers
that join later (or restart) need no router-side set-up, and no worker has to open a port.

Frames are (topic, 8-byte big-endian sequence number, msgpack batch); see :mod:`pdserve.conductor.events`.
A lost batch or a publisher restart clears that worker's entries (re-learned from later events), so the index
can under-state a worker's cache but never claims blocks it no longer has.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from ...conductor import Conductor
from ...conductor.events import EventTranslator, decode_batch

log = logging.getLogger("pdserve.router.fleet.kv_events")


class KVEventSink:
    def __init__(self, endpoint: str, conductor: Conductor, block_size: int) -> None:
        self.conductor = conductor
        self.block_size = block_size
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.translators: dict[str, EventTranslator] = {}
        self.batches: dict[str, int] = {}
        self.skipped_blocks = 0
        self.bad_batches = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                self.handle(await self.sock.recv_multipart())
        except asyncio.CancelledError:
            pass
        except Exception:  # never let a bad publisher kill the router
            log.exception("KV event sink stopped")

    def forget(self, worker: str) -> None:
        self.translators.pop(worker, None)

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_batches += 1
            return
        try:
            worker = frames[0].decode().rstrip("/")
            events = decode_batch(frames[2])
        except (UnicodeDecodeError, ValueError):
            self.bad_batches += 1
            return
        tr = self.translators.get(worker)
        if tr is None:
            tr = self.translators[worker] = EventTranslator(self.block_size)
        if tr.sequence(int.from_bytes(frames[1], "big")):
            log.info("KV events from %s: gap or restart; clearing its index entries", worker)
            self.conductor.all_cleared(worker)
        up = tr.apply(events)
        self.batches[worker] = self.batches.get(worker, 0) + 1
        self.skipped_blocks += up.skipped
        up.apply_to(worker, self.conductor)

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        self.sock.close(0)
        self.ctx.term()
