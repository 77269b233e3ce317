"""Per-request records and the measures every benchmark reports (DESIGN.md section 8)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np


@dataclass
class RequestRecord:
    """What one streamed request looked like from the client's side (seconds, monotonic)."""

    ok: bool
    start: float
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    timings: dict[str, Any] | None = None  # the router's pdserve_timings, when asked for

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def latency_s(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot_s(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1), as vLLM's and SGLang's benchmarks define it."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def percentiles(values: Iterable[float | None], qs: tuple[int, ...] = (50, 90, 99)) -> dict[int, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {q: None for q in qs}
    return {q: float(np.percentile(vals, q)) for q in qs}


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """TTFT, TPOT, ITL, latency p50/p90/p99 in ms; throughput; error count."""
    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {"requests": len(records), "errors": len(records) - len(ok)}
    series = {
        "ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok],
        "itl": [x for r in ok for x in r.itls_s], "e2e": [r.latency_s for r in ok],
    }
    for name, vals in series.items():
        for q, v in percentiles(vals).items():
            out[f"{name}_p{q}_ms"] = None if v is None else round(v * 1e3, 2)
    out["req_per_s"] = round(len(ok) / wall_s, 3) if wall_s > 0 else None
    out["output_tok_per_s"] = round(sum(r.output_tokens for r in ok) / wall_s, 2) if wall_s > 0 else None
    return out
