"""Subscribes to each worker's vLLM KV event publisher (ZMQ PUB) and feeds the conductor's prefix index.

Frames are (topic, 8-byte big-endian sequence number, msgpack batch); see :mod:`pdserve.conductor.events`.
A lost batch or a publisher restart clears that worker's entries (re-learned from later events), so the index
can under-state a worker's cache but never claims blocks it no longer has.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from ..conductor import Conductor
from ..conductor.events import EventTranslator, decode_batch

log = logging.getLogger("pdserve.router.kv_events")


class KVEventSubscriber:
    def __init__(self, ctx: zmq.asyncio.Context, worker_url: str, endpoint: str, conductor: Conductor,
                 block_size: int) -> None:
        self.worker_url = worker_url
        self.endpoint = endpoint
        self.conductor = conductor
        self.translator = EventTranslator(block_size)
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches = 0
        self.skipped_blocks = 0
        self.bad_batches = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                frames = await self.sock.recv_multipart()
                self.handle(frames)
        except asyncio.CancelledError:
            pass
        except Exception:  # never let a bad publisher kill the router
            log.exception("KV event subscriber for %s stopped", self.worker_url)

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or len(frames[-2]) != 8:
            self.bad_batches += 1
            return
        seq = int.from_bytes(frames[-2], "big")
        try:
            events = decode_batch(frames[-1])
        except ValueError:
            self.bad_batches += 1
            return
        if self.translator.sequence(seq):
            log.info("KV events from %s: gap or restart at seq %d; clearing its index entries", self.worker_url, seq)
            self.conductor.all_cleared(self.worker_url)
        up = self.translator.apply(events)
        self.batches += 1
        self.skipped_blocks += up.skipped
        up.apply_to(self.worker_url, self.conductor)

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        self.sock.close(0)
