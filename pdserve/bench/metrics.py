"""Per-request records and the measures every benchmark reports (DESIGN.md section 8).

Definitions (the same as vLLM's and SGLang's serving benchmarks):

- TTFT: request sent -> first content chunk received (client clock).
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1); undefined for one-token outputs.
- ITL: gaps between consecutive content chunks (every chunk, across requests).
- Hand-off gap: first content chunk -> second content chunk of one request (client clock); undefined for answers of
  fewer than two chunks. In a PD run it spans the hand-off (P streams the first token, D the second); colocated it
  is one decode step, so set beside TPOT p50 it shows what the hand-off adds.
- E2E: request sent -> last byte of the stream.
- Throughput: successful requests and their output tokens per second of wall time (first send -> last end).
- Goodput: successful requests per second that met *both* the TTFT and the TPOT target (a request without a TPOT,
  i.e. one output token, meets the TPOT target); ``slo_attainment`` is that count over all requests sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

QUANTILES = (50, 90, 99)
# Router per-request timing fields (pdserve/router/run/generation.py Timings.report), summarized as phases.
PHASE_FIELDS = ("queue_ms", "prefill_ms", "kv_transfer_ms", "handoff_ms", "decode_ms", "router_overhead_ms")


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
    session: int = 0
    turn: int = 0
    scheduled_s: float | None = None  # when the workload wanted it sent (from the run's start)

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
    def handoff_gap_s(self) -> float | None:
        """Second content chunk's arrival - the first's (the hand-off gap); None with fewer than two chunks."""
        if not self.ok or len(self.chunk_times) < 2:
            return None
        return self.chunk_times[1] - self.chunk_times[0]

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_dict(self, t0: float = 0.0) -> dict[str, Any]:
        """JSON-ready, times relative to ``t0`` (the run's start)."""
        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 6)

        return {"ok": self.ok, "session": self.session, "turn": self.turn, "scheduled_s": self.scheduled_s,
                "start_s": rel(self.start), "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "e2e_s": self.latency_s, "handoff_gap_s": self.handoff_gap_s, "end_s": rel(self.end),
                "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "itl_s": [round(x, 6) for x in self.itls_s],
                "error": self.error, "timings": self.timings}


def record_from_dict(d: dict[str, Any]) -> RequestRecord:
    """Inverse of :meth:`RequestRecord.to_dict` (times relative to the run's start)."""
    start = d["start_s"]
    first = None if d.get("ttft_s") is None else start + d["ttft_s"]
    end = None if d.get("e2e_s") is None else start + d["e2e_s"]
    chunks: list[float] = []
    if first is not None:
        chunks = [first]
        for gap in d.get("itl_s") or []:
            chunks.append(chunks[-1] + gap)
    return RequestRecord(ok=d["ok"], start=start, first_token=first, end=end, chunk_times=chunks,
                         output_tokens=d.get("output_tokens", 0), prompt_tokens=d.get("prompt_tokens", 0),
                         error=d.get("error"), timings=d.get("timings"), session=d.get("session", 0),
                         turn=d.get("turn", 0), scheduled_s=d.get("scheduled_s"))


@dataclass(frozen=True)
class SLO:
    """Goodput targets in milliseconds (None: no target on that measure)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, rec: RequestRecord) -> bool:
        if not rec.ok:
            return False
        if self.ttft_ms is not None and (rec.ttft_s is None or rec.ttft_s * 1e3 > self.ttft_ms):
            return False
        tpot = rec.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False
        return True


def percentiles(values: Iterable[float | None], qs: tuple[int, ...] = QUANTILES) -> dict[int, float | None]:
    """Linear-interpolated percentiles (numpy's default) of the values that are not None."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {q: None for q in qs}
    return {q: float(np.percentile(vals, q)) for q in qs}


def _stats_ms(name: str, values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    out: dict[str, float | None] = {f"{name}_mean_ms": round(float(np.mean(vals)) * 1e3, 2) if vals else None}
    for q, v in percentiles(vals).items():
        out[f"{name}_p{q}_ms"] = None if v is None else round(v * 1e3, 2)
    return out


def goodput(records: list[RequestRecord], wall_s: float, slo: SLO) -> dict[str, float | None]:
    met = sum(1 for r in records if slo.met(r))
    return {"goodput_req_per_s": round(met / wall_s, 4) if wall_s > 0 else None,
            "slo_attainment": round(met / len(records), 4) if records else None}


def summarize(records: list[RequestRecord], wall_s: float, slo: SLO | None = None) -> dict[str, Any]:
    """TTFT, TPOT, ITL, E2E and the hand-off gap (``handoff_gap_*``) mean/p50/p90/p99 in ms; throughput; goodput
    (when ``slo`` is given); errors."""
    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {"requests": len(records), "errors": len(records) - len(ok)}
    series: dict[str, list[float | None]] = {
        "ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok],
        "itl": [x for r in ok for x in r.itls_s], "e2e": [r.latency_s for r in ok],
        "handoff_gap": [r.handoff_gap_s for r in ok],
    }
    for name, vals in series.items():
        out.update(_stats_ms(name, vals))
    gap, tpot = out.get("handoff_gap_p50_ms"), out.get("tpot_p50_ms")
    out["handoff_gap_over_tpot_p50"] = round(gap / tpot, 3) if gap is not None and tpot else None
    out["wall_s"] = round(wall_s, 3)
    out["req_per_s"] = round(len(ok) / wall_s, 4) if wall_s > 0 else None
    out["output_tok_per_s"] = round(sum(r.output_tokens for r in ok) / wall_s, 2) if wall_s > 0 else None
    out["prompt_tokens_mean"] = round(float(np.mean([r.prompt_tokens for r in ok])), 1) if ok else None
    if slo is not None:
        out.update(goodput(records, wall_s, slo))
    return out


def phase_summary(records: list[RequestRecord]) -> dict[str, Any]:
    """Router-side phases (p50, p99 and mean, ms), KV bytes per request, and the KV transfer's share of TTFT.

    Empty when the server returned no ``pdserve_timings`` (a plain vLLM server, or a router without them)."""
    timings = [r.timings for r in records if r.ok and r.timings]
    if not timings:
        return {}
    out: dict[str, Any] = {"timed_requests": len(timings)}
    modes: dict[str, int] = {}
    for t in timings:
        modes[str(t.get("mode"))] = modes.get(str(t.get("mode")), 0) + 1
    out["modes"] = modes
    for key in PHASE_FIELDS + ("kv_transfer_bytes",):
        vals = [float(t[key]) for t in timings if t.get(key) is not None]
        base = key[:-3] if key.endswith("_ms") else key
        unit = "_ms" if key.endswith("_ms") else ""
        out[f"{base}_p50{unit}"] = round(float(np.median(vals)), 3) if vals else None
        out[f"{base}_mean{unit}"] = round(float(np.mean(vals)), 3) if vals else None
        out[f"{base}_p99{unit}"] = round(float(np.percentile(vals, 99)), 3) if vals else None
    shares = [t["kv_transfer_ms"] / t["ttft_ms"] for t in timings
              if t.get("kv_transfer_ms") is not None and t.get("ttft_ms")]
    out["transfer_share_p50"] = round(float(np.median(shares)), 5) if shares else None
    return out


def counter_phases(kv: dict[str, float], router: dict[str, float], ttft_p50_ms: float | None,
                   handoff_p50_ms: float | None = None) -> dict[str, Any]:
    """Phases from Prometheus counter deltas over a run: decode workers' ``vllm:pdserve_kv_*`` (KV reads, bytes,
    seconds) and the router's ``pdserve_router_phase_seconds`` sums (used when per-request timings lack a field;
    vLLM 0.32 leaves kv_transfer_params out of streamed answers, so the KV numbers come from here)."""
    out: dict[str, Any] = {}
    reads = kv.get("vllm:pdserve_kv_reads_total", 0.0)
    if reads:
        out["kv_reads"] = int(reads)
        out["kv_read_mean_ms"] = round(kv.get("vllm:pdserve_kv_read_seconds_sum", 0.0) * 1e3 / reads, 3)
        out["kv_read_mean_bytes"] = round(kv.get("vllm:pdserve_kv_read_bytes_total", 0.0) / reads, 1)
        if ttft_p50_ms:
            out["kv_read_share_of_ttft_p50"] = round(out["kv_read_mean_ms"] / ttft_p50_ms, 5)
        if handoff_p50_ms:  # the read happens in the hand-off (after P's first token): its share of that gap
            out["kv_read_share_of_handoff_p50"] = round(out["kv_read_mean_ms"] / handoff_p50_ms, 5)
    for key, value in sorted(router.items()):
        if key.startswith("pdserve_router_handoffs_total"):
            out[key.replace("pdserve_router_", "")] = int(value)
    return out
