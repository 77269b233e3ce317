"""What a simulation (or a benchmark) reports: latency percentiles, goodput at targets, pool utilisation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    tpot_s: float


def percentiles(values: Sequence[float], ps: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    if len(values) == 0:
        return {f"p{p}": None for p in ps}
    arr = np.asarray(values, dtype=float)
    return {f"p{p}": float(np.percentile(arr, p)) for p in ps}


def summarize(jobs: Sequence[Any], targets: Targets, busy: dict[str, list[tuple[float, float]]],
              ) -> dict[str, Any]:
    """Summary of simulated jobs (``pdserve.plan.worker.Job``) and per-pool (busy s, makespan s) pairs."""
    done = [j for j in jobs if j.done_s is not None]
    rejected = [j for j in jobs if j.rejected]
    ttft = [j.first_token_s - j.req.arrival_s for j in done]
    tpot = [(j.done_s - j.first_token_s) / (j.req.output_tokens - 1) for j in done if j.req.output_tokens > 1]
    itl = np.concatenate([np.asarray(j.gaps) for j in done if j.gaps]) if any(j.gaps for j in done) else []
    e2e = [j.done_s - j.req.arrival_s for j in done]
    gap = [j.gaps[0] for j in done if j.gaps]  # first -> second token: the hand-off on PD, a decode step colocated
    arrivals = [j.req.arrival_s for j in jobs]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
    end = max((j.done_s for j in done), default=0.0)
    window = max(span, 1e-9)
    good = sum(1 for j in done if j.first_token_s - j.req.arrival_s <= targets.ttft_s and (
        j.req.output_tokens <= 1 or (j.done_s - j.first_token_s) / (j.req.output_tokens - 1) <= targets.tpot_s))
    return {
        "requests": len(jobs), "completed": len(done), "rejected": len(rejected),
        "offered_rate": (len(jobs) - 1) / window if span > 0 else 0.0,
        "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e), "handoff_gap_s": percentiles(gap),
        "throughput_rps": len(done) / max(end - min(arrivals, default=0.0), 1e-9),
        "output_tps": sum(j.req.output_tokens for j in done) / max(end - min(arrivals, default=0.0), 1e-9),
        "goodput_rps": good / window if span > 0 else float(good),
        "slo_attainment": good / len(jobs) if jobs else 0.0,
        "utilization": {pool: sum(b for b, _ in v) / max(sum(m for _, m in v), 1e-9) for pool, v in busy.items()},
        "makespan_s": end,
    }
