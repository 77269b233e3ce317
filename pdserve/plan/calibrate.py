"""Fit the planner's cost model to a live pdserve router (or a vLLM server) on this machine.

Prefill: TTFT of single requests (concurrency 1) at several prompt lengths -> a + b*n + c*n*(cached + n/2).
Decode: median gap between streamed tokens with ``batch`` requests running together -> d0 + d1*batch + d2*ctx.
The same features as the conductor's online model (pdserve.conductor.cost_model), fitted the same way."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.conductor.cost_model import WindowFit, decode_features, prefill_features
from pdserve.dtype import choose_dtype


@dataclass
class Calibration:
    """Fitted coefficients (seconds) plus the transfer figures the fit cannot see."""

    prefill_coef: list[float]
    decode_coef: list[float]
    kv_bytes_per_token: int
    bandwidth_bytes_s: float
    transfer_overhead_s: float = 0.002
    handoff_s: float = 0.0
    samples: dict[str, list[list[float]]] = field(default_factory=dict)
    # the dtype the fit holds for: the CPU rule's (pdserve.dtype), which `pdserve serve` runs workers in unless
    # --dtype overrides it; a server started in another dtype needs its own calibration
    dtype: str = ""
    dtype_reason: str = ""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls(**json.loads(Path(path).read_text()))

    def cost_model(self) -> FittedCostModel:
        return FittedCostModel(self)


class FittedCostModel:
    """The conductor's CostModel protocol with fixed, fitted coefficients (no online refit)."""

    def __init__(self, cal: Calibration) -> None:
        self.cal = cal
        self.kv_bytes_per_token = cal.kv_bytes_per_token
        self.handoff_s = cal.handoff_s

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return max(0.0, sum(c * x for c, x in zip(self.cal.prefill_coef, prefill_features(new_tokens, cached_tokens))))

    def decode_step_s(self, batch: int, total_context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return max(0.0, sum(c * x for c, x in zip(self.cal.decode_coef, decode_features(batch, total_context_tokens))))

    def transfer_s(self, nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else self.cal.transfer_overhead_s + nbytes / self.cal.bandwidth_bytes_s


def fit(prefill: Sequence[tuple[int, float]], decode: Sequence[tuple[int, int, float]], kv_bytes_per_token: int,
        bandwidth_bytes_s: float, handoff_s: float = 0.0) -> Calibration:
    """prefill: (prompt tokens, TTFT s); decode: (batch, total context tokens, step s)."""
    pf = WindowFit((0.0, 0.0, 0.0), window=max(8, len(prefill)), min_obs=3)
    for n, s in prefill:
        pf.add(prefill_features(n, 0), s)
    df = WindowFit((0.0, 0.0, 0.0), window=max(8, len(decode)), min_obs=2)
    for b, ctx, s in decode:
        df.add(decode_features(b, ctx), s)
    return Calibration([float(c) for c in pf.coefficients(force=True)],
                       [float(c) for c in df.coefficients(force=True)],
                       kv_bytes_per_token, bandwidth_bytes_s, handoff_s=handoff_s,
                       samples={"prefill": [list(map(float, p)) for p in prefill],
                                "decode": [list(map(float, d)) for d in decode]})


async def _model_name(session: Any, url: str) -> str | None:
    try:
        async with session.get(f"{url}/v1/models") as resp:
            data = await resp.json()
            return data["data"][0]["id"]
    except Exception:  # noqa: BLE001 - the router does not need a name
        return None


async def measure(url: str, prompt_lengths: Sequence[int] = (64, 256, 512, 1024, 1536),
                  decode_shapes: Sequence[tuple[int, int]] = ((1, 64), (2, 64), (4, 64), (8, 64), (1, 1024), (4, 1024)),
                  decode_tokens: int = 48,
                  repeats: int = 2, vocab: tuple[int, int] = (1000, 20000), seed: int = 0,
                  prefill_parallel: int = 1, background_streams: int = 0
                  ) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:
    """(prefill samples, decode samples) from a live server. Prompts are random token ids (no cache hits).

    decode_shapes: (batch, prompt tokens) pairs; two prompt lengths separate the per-sequence and per-token terms.
    prefill_parallel: probes sent at once (one per prefill worker behind a round-robin router: every engine
    busy, as under load); background_streams: long decodes kept running meanwhile (keeps PD decode workers and
    the processes streaming their tokens busy, as under load)."""
    import aiohttp

    from pdserve.bench.client import stream_completion

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(*vocab) for _ in range(n)]  # noqa: E731
    url = url.rstrip("/")
    async with aiohttp.ClientSession() as session:
        name = await _model_name(session, url)
        base = {"model": name} if name else {}
        await stream_completion(session, url, dict(base, prompt=ids(16), max_tokens=2))  # warm-up
        stop = asyncio.Event()

        async def background() -> None:
            while not stop.is_set():
                await stream_completion(session, url, dict(base, prompt=ids(32), max_tokens=128, ignore_eos=True))

        loops = [asyncio.create_task(background()) for _ in range(background_streams)]
        if loops:
            await asyncio.sleep(1.0)
        prefill = []
        for _ in range(repeats):
            for n in prompt_lengths:
                recs = await asyncio.gather(*(stream_completion(session, url, dict(base, prompt=ids(n), max_tokens=1))
                                              for _ in range(prefill_parallel)))
                for rec in recs:
                    if not rec.ok or rec.ttft_s is None:
                        raise RuntimeError(f"calibration request failed: {rec.error}")
                    prefill.append((n, rec.ttft_s))
        stop.set()
        await asyncio.gather(*loops)
        decode = []
        for b, decode_prompt in decode_shapes:
            payloads = [dict(base, prompt=ids(decode_prompt), max_tokens=decode_tokens, ignore_eos=True)
                        for _ in range(b)]
            recs = await asyncio.gather(*(stream_completion(session, url, p) for p in payloads))
            gaps = [t1 - t0 for r in recs if r.ok for t0, t1 in zip(r.chunk_times[1:], r.chunk_times[2:])]
            if not gaps:
                raise RuntimeError(f"calibration: no streamed tokens at batch {b}: {recs[0].error}")
            decode.append((b, b * (decode_prompt + decode_tokens // 2), statistics.median(gaps)))
    return prefill, decode


def calibrate(url: str, kv_bytes_per_token: int, bandwidth_bytes_s: float, handoff_s: float = 0.0,
              dtype: str | None = None, **kw: Any) -> Calibration:
    """Measure the server at ``url`` and fit; the result records ``dtype`` (default: the CPU rule's, the one
    ``pdserve serve`` picks on this machine) so a fit is not reused for a server in another dtype unawares."""
    choice = choose_dtype(dtype)
    prefill, decode = asyncio.run(measure(url, **kw))
    cal = fit(prefill, decode, kv_bytes_per_token, bandwidth_bytes_s, handoff_s)
    cal.dtype, cal.dtype_reason = choice.dtype, choice.reason
    return cal
