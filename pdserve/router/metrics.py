"""Prometheus text exposition for the router (no global registry: one :class:`RouterMetrics` per app)."""

from __future__ import annotations

import bisect
from typing import Any, Iterable

# Seconds: 1 ms .. 60 s (phase timings on CPU range from sub-ms router overhead to multi-second prefills).
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5,
                2.5, 5.0, 10.0, 20.0, 60.0)
BYTE_BUCKETS = tuple(float(1 << k) for k in range(10, 36, 2))  # 1 KiB .. 32 GiB


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_esc(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labels = name, help, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for lv, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labels, lv)} {_num(v)}"


class Gauge(Counter):
    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = float(value)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        for lv, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labels, lv)} {_num(v)}"


class Histogram:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = TIME_BUCKETS) -> None:
        self.name, self.help, self.labels, self.buckets = name, help, labels, tuple(sorted(buckets))
        self.series: dict[tuple[str, ...], list] = {}  # labels -> [counts per bucket..., sum, count]

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0] * len(self.buckets) + [0.0, 0]
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[i] += 1
        s[-2] += value
        s[-1] += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for lv, s in sorted(self.series.items()):
            cum = 0
            for b, c in zip(self.buckets, s):
                cum += c
                le = 'le="' + _num(b) + '"'
                yield f"{self.name}_bucket{_labels(self.labels, lv, le)} {cum}"
            inf = 'le="+Inf"'
            yield f"{self.name}_bucket{_labels(self.labels, lv, inf)} {s[-1]}"
            yield f"{self.name}_sum{_labels(self.labels, lv)} {repr(float(s[-2]))}"
            yield f"{self.name}_count{_labels(self.labels, lv)} {s[-1]}"


# Timing fields (milliseconds in responses) -> histogram phase label (seconds in Prometheus).
PHASES = ("queue", "prefill", "kv_transfer", "handoff", "ttft", "tpot", "decode", "e2e", "router_overhead")


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = Counter("pdserve_router_requests_total", "Requests finished, by endpoint and HTTP status "
                                "(a stream that failed after its 200 header counts as status=\"stream_error\").",
                                ("endpoint", "status"))
        self.phase = Histogram("pdserve_router_phase_seconds", "Per-request phase timings measured by the router.",
                               ("mode", "phase"))
        self.kv_bytes = Histogram("pdserve_router_kv_transfer_bytes", "KV bytes moved P->D per request, as "
                                  "reported by the connector.", (), BYTE_BUCKETS)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens_total", "Prompt tokens of finished requests.")
        self.completion_tokens = Counter("pdserve_router_completion_tokens_total",
                                         "Completion tokens of finished requests.")
        self.handoffs = Counter("pdserve_router_handoffs_total", "P->D hand-offs by outcome (kv: P returned "
                                "kv_transfer_params; no_kv: it did not, D recomputes; skipped: done after t1).",
                                ("outcome",))
        self.worker_errors = Counter("pdserve_router_worker_errors_total", "Failed worker calls.", ("role", "kind"))
        self.inflight = Gauge("pdserve_router_inflight_requests", "Requests in flight.")
        self.worker_healthy = Gauge("pdserve_router_worker_healthy", "1 when the worker's last /health probe "
                                    "succeeded.", ("role", "url"))
        self.inflight.set(0)

    def observe_timings(self, mode: str, timings: dict) -> None:
        for phase in PHASES:
            v = timings.get(f"{phase}_ms")
            if v is not None:
                self.phase.observe(v / 1000.0, mode, phase)
        b = timings.get("kv_transfer_bytes")
        if b is not None:
            self.kv_bytes.observe(float(b))

    def render(self) -> str:
        lines: list[str] = []
        for m in (self.requests, self.phase, self.kv_bytes, self.prompt_tokens, self.completion_tokens,
                  self.handoffs, self.worker_errors, self.inflight, self.worker_healthy):
            lines.extend(m.render())
        return "\n".join(lines) + "\n"


def conductor_metrics_text(placement: "Any", event_batches: dict[str, int]) -> str:
    """Per-worker load gauges (the autoscaling signals) and the conductor's own counters, rendered fresh."""
    c = placement.conductor
    q = Gauge("pdserve_worker_queued_prefill_tokens", "Prompt tokens placed on the worker and not yet prefilled.",
              ("worker", "role"))
    r = Gauge("pdserve_worker_running_requests", "Requests placed on the worker to decode (running or awaiting "
              "their KV).", ("worker", "role"))
    kv = Gauge("pdserve_worker_kv_usage", "KV cache in use, 0..1 (worker-reported when fresh, else the "
               "conductor's reservations).", ("worker", "role"))
    blocks = Gauge("pdserve_conductor_indexed_blocks", "Blocks the prefix index holds, per holder.", ("holder",))
    for s in c.snapshot():
        labels = (s["worker"], s["role"])
        q.set(s["queued_prefill_tokens"], *labels)
        r.set(s["running_requests"], *labels)
        cap = s["kv_capacity_tokens"]
        kv.set(min(1.0, s["kv_used_tokens"] / cap) if cap else 0.0, *labels)
    for h in c.index.holders():
        blocks.set(c.index.blocks_of(h), h)
    dec = Counter("pdserve_conductor_decisions_total", "Placements by outcome (disaggregated, local, reject).",
                  ("kind",))
    for kind, n in c.counts.items():
        dec.inc(kind, amount=n)
    hist = Histogram("pdserve_conductor_decision_seconds", "Time to choose a placement (recent decisions).")
    for v in list(placement.decision_seconds):
        hist.observe(v)
    ev = Counter("pdserve_conductor_kv_event_batches_total", "KV event batches received per worker.", ("worker",))
    for url, n in event_batches.items():
        ev.inc(url, amount=n)
    lines: list[str] = []
    for m in (q, r, kv, blocks, dec, hist, ev):
        lines.extend(m.render())
    return "\n".join(lines) + "\n"
