"""Ask a worker's vLLM KV event publisher for the batches it still holds (its replay endpoint).

vLLM's ``ZmqEventPublisher`` binds a ROUTER socket at ``replay_endpoint`` and keeps its last ``buffer_steps``
batches. A request is one frame, the first sequence number wanted (8 bytes, big-endian); the answer is one
message per buffered batch from there, ``(topic, seq, payload)``, then ``("", -1, "")``. A DEALER socket sends
the request with the empty delimiter frame a REQ socket would add and takes the many replies a REQ could not.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

log = logging.getLogger("pdserve.router.fleet.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 5.0  # no answer by then (a worker not up yet, or gone): live events only, clear-on-gap


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int,
                 timeout_s: float = REPLAY_TIMEOUT_S) -> list[tuple[int, bytes]] | None:
    """The (seq, payload) batches from ``start`` the publisher still holds, in order; None when it does not
    answer within ``timeout_s`` (between two batches) or answers garbage."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            if not await sock.poll(int(timeout_s * 1000)):
                log.info("KV event replay from %s: no answer in %.1f s", endpoint, timeout_s)
                return None
            frames = await sock.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                log.warning("KV event replay from %s: unexpected frames", endpoint)
                return None
            if frames[2] == END_SEQ:
                return out
            out.append((int.from_bytes(frames[2], "big"), frames[3]))
    except (zmq.ZMQError, asyncio.TimeoutError) as e:
        log.info("KV event replay from %s failed: %s", endpoint, e)
        return None
    finally:
        sock.close(0)
