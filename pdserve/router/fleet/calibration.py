"""Start-up calibration of the conductor's cost model: time a few prefills of different lengths on each worker
that prefills, and one short decode on each worker that decodes, with prompts of random (uncached) tokens.

Runs in the background once the workers answer /health; client requests are served meanwhile (they only
see the default coefficients until then). The online fit keeps refining from real traffic afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

from ...conductor import Conductor
from ..workers.client import Wait, Worker, WorkerClient, WorkerError

log = logging.getLogger("pdserve.router.fleet.calibration")


def calibration_lengths(max_model_len: int) -> list[int]:
    cap = max(16, max_model_len // 2)
    return sorted({min(n, cap) for n in (32, 256, 1024)})


async def calibrate(client: WorkerClient, conductor: Conductor, workers: Sequence[Worker], vocab_size: int,
                    max_model_len: int, wait_healthy_s: float = 900.0, repeats: int = 2) -> dict:
    """Returns what was measured ({"prefill": [(url, tokens, s)], "decode": [(url, step_s)]})."""
    rng = random.Random(0x5EED)
    hi = max(2, min(vocab_size, 32000))
    deadline = time.monotonic() + wait_healthy_s
    while time.monotonic() < deadline:
        ok = await asyncio.gather(*(client.health(w.url, 2.0) for w in workers))
        if ok and all(o for o, _ in ok):
            break
        await asyncio.sleep(1.0)
    out: dict = {"prefill": [], "decode": []}
    cost = conductor.cost
    for w in list(workers):
        role = conductor.workers.get(w.url)
        if role is None:
            continue
        if role.can_prefill or role.role == "colocated":
            for _ in range(repeats):
                for n in calibration_lengths(max_model_len):
                    body = {"prompt": [rng.randrange(1, hi) for _ in range(n)], "max_tokens": 1, "temperature": 0}
                    t0 = time.perf_counter()
                    try:
                        await client.complete(w.url, body, Wait())
                    except WorkerError as e:
                        log.warning("calibration prefill on %s failed: %s", w.url, e)
                        break
                    s = time.perf_counter() - t0
                    getattr(cost, "observe_prefill", lambda *a: None)(n, 0, s)
                    out["prefill"].append((w.url, n, round(s, 4)))
        if role.can_decode or role.role == "colocated":
            body = {"prompt": [rng.randrange(1, hi) for _ in range(32)], "max_tokens": 24, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            stamps: list[float] = []
            try:
                async for obj in client.stream(w.url, body, Wait()):
                    if (obj.get("choices") or [{}])[0].get("text"):
                        stamps.append(time.perf_counter())
            except WorkerError as e:
                log.warning("calibration decode on %s failed: %s", w.url, e)
                continue
            gaps = [b - a for a, b in zip(stamps[2:], stamps[3:])]
            for i, g in enumerate(gaps):
                getattr(cost, "observe_decode_step", lambda *a: None)(1, 35 + i, g)
            if gaps:
                out["decode"].append((w.url, round(sorted(gaps)[len(gaps) // 2], 5)))
    describe = getattr(cost, "describe", None)
    log.info("calibrated cost model: %s", describe() if describe else out)
    return out


class Calibration:
    """The start-up calibration (``--calibrate``): run once, its measurements kept for GET /v1/pdserve/workers."""

    def __init__(self) -> None:
        self.result: dict | None = None

    async def run(self, client: WorkerClient, conductor: Conductor, workers: Sequence[Worker], vocab_size: int,
                  max_model_len: int) -> None:
        try:
            self.result = await calibrate(client, conductor, workers, vocab_size, max_model_len)
        except Exception:
            log.exception("start-up calibration failed; the cost model keeps its defaults")
