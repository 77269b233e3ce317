"""The router's Prometheus metrics, through prometheus_client with one :class:`CollectorRegistry` per app (never the
global one: several apps in one process keep their own numbers).

Request metrics are instruments updated as requests finish; the per-worker load gauges and the conductor's
counters are read fresh from the conductor at each scrape (:class:`ConductorCollector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Seconds: 1 ms .. 60 s (phase timings on CPU range from sub-ms router overhead to multi-second prefills).
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5,
                2.5, 5.0, 10.0, 20.0, 60.0)
BYTE_BUCKETS = tuple(float(1 << k) for k in range(10, 36, 2))  # 1 KiB .. 32 GiB

# Timing fields (milliseconds in responses) -> histogram phase label (seconds in Prometheus).
PHASES = ("queue", "prefill", "kv_transfer", "handoff", "ttft", "tpot", "decode", "e2e", "router_overhead")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pdserve_router_requests_total", "Requests finished, by endpoint and HTTP status "
                                "(a stream that failed after its 200 header counts as status=\"stream_error\").",
                                ("endpoint", "status"), registry=r)
        self.phase = Histogram("pdserve_router_phase_seconds", "Per-request phase timings measured by the router.",
                               ("mode", "phase"), buckets=TIME_BUCKETS, registry=r)
        self.kv_bytes = Histogram("pdserve_router_kv_transfer_bytes", "KV bytes moved P->D per request, as "
                                  "reported by the connector.", buckets=BYTE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens_total", "Prompt tokens of finished requests.",
                                     registry=r)
        self.completion_tokens = Counter("pdserve_router_completion_tokens_total",
                                         "Completion tokens of finished requests.", registry=r)
        self.handoffs = Counter("pdserve_router_handoffs_total", "P->D hand-offs by outcome (kv: P returned "
                                "kv_transfer_params; no_kv: it did not, D recomputes; skipped: done after t1; early: "
                                "D sent while P prefills; early_fallback: such a D gave way to the serial hand-off).",
                                ("outcome",), registry=r)
        self.sidecar_pairs = Counter("pdserve_router_sidecar_pairs_total", "--prefiller-header (a gateway's decode "
                                     "sidecar): first placements by what x-prefiller-host-port gave (pair: P named "
                                     "and the local D; no_header, unknown_host, bad_header, unhealthy: the whole "
                                     "request on the local D).", ("outcome",), registry=r)
        self.worker_errors = Counter("pdserve_router_worker_errors_total", "Failed worker calls.", ("role", "kind"),
                                     registry=r)
        self.inflight = Gauge("pdserve_router_inflight_requests", "Requests in flight.", registry=r)
        self.migrations = Counter("pdserve_router_migrations_total", "Requests moved to another worker after "
                                  "theirs failed with them in flight, by the failed worker's role.", ("role",),
                                  registry=r)
        self.deadlines = Counter("pdserve_router_deadline_exceeded_total", "Requests failed by a deadline "
                                 "(request: --request-timeout-s; handoff: --handoff-timeout-s).", ("deadline",),
                                 registry=r)
        self.rejected = Counter("pdserve_router_rejected_total", "Requests answered 429 by the router's in-flight "
                                "limits, by limit.", ("limit",), registry=r)
        self.worker_healthy = Gauge("pdserve_router_worker_healthy", "1 while the router places requests on the "
                                    "worker (taken out on evidence of death or probes failing over a window).",
                                    ("role", "url"), registry=r)
        self.worker_returns = Counter("pdserve_router_worker_returns_total", "Times a worker the router had taken "
                                      "out answered its health probe again (a restart, as the router sees it).",
                                      ("url",), registry=r)
        self.moves = Counter("pdserve_router_moves_total", "Running decodes moved to another worker because theirs "
                             "started a long prefill (the KV moves through the connector as a P->D hand-off).",
                             registry=r)
        self.move_gap = Histogram("pdserve_router_move_gap_seconds", "From the stop on the old worker to the first "
                                  "token after a move.", buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10),
                                  registry=r)

    def observe_timings(self, mode: str, timings: dict) -> None:
        for phase in PHASES:
            v = timings.get(f"{phase}_ms")
            if v is not None:
                self.phase.labels(mode, phase).observe(v / 1000.0)
        b = timings.get("kv_transfer_bytes")
        if b is not None:
            self.kv_bytes.observe(float(b))

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of everything registered here."""
        return generate_latest(self.registry).decode()


def _histogram(name: str, help: str, values: Iterable[float], buckets: tuple[float, ...] = TIME_BUCKETS
               ) -> HistogramMetricFamily:
    vs = list(values)
    fam = HistogramMetricFamily(name, help)
    if vs:
        counts = [(floatToGoString(b), float(sum(1 for v in vs if v <= b))) for b in buckets]
        fam.add_metric([], counts + [("+Inf", float(len(vs)))], sum(vs))
    return fam


class ConductorCollector(Collector):
    """Per-worker load gauges (the autoscaling signals) and the conductor's own counters, read at each scrape.
    ``placement`` is a :class:`~pdserve.router.fleet.placement.ConductorPlacement`; ``event_batches`` returns KV event
    batches received per worker."""

    def __init__(self, placement: Any, event_batches: Callable[[], dict[str, int]] = dict) -> None:
        self.placement = placement
        self.event_batches = event_batches

    def collect(self) -> Iterable[Metric]:
        c = self.placement.conductor
        labels = ["worker", "role"]
        q = GaugeMetricFamily("pdserve_worker_queued_prefill_tokens", "Prompt tokens placed on the worker and not "
                              "yet prefilled.", labels=labels)
        r = GaugeMetricFamily("pdserve_worker_running_requests", "Requests placed on the worker to decode (running "
                              "or awaiting their KV).", labels=labels)
        kv = GaugeMetricFamily("pdserve_worker_kv_usage", "KV cache in use, 0..1 (worker-reported when fresh, else "
                               "the conductor's reservations).", labels=labels)
        for s in c.snapshot():
            lv = [s["worker"], s["role"]]
            q.add_metric(lv, s["queued_prefill_tokens"])
            r.add_metric(lv, s["running_requests"])
            cap = s["kv_capacity_tokens"]
            kv.add_metric(lv, min(1.0, s["kv_used_tokens"] / cap) if cap else 0.0)
        blocks = GaugeMetricFamily("pdserve_conductor_indexed_blocks", "Blocks the prefix index holds, per holder.",
                                   labels=["holder"])
        for h in c.index.holders():
            blocks.add_metric([h], c.index.blocks_of(h))
        dec = CounterMetricFamily("pdserve_conductor_decisions_total", "Placements by outcome (disaggregated, "
                                  "local, reject).", labels=["kind"])
        for kind, n in c.counts.items():
            dec.add_metric([kind], n)
        ev = CounterMetricFamily("pdserve_conductor_kv_event_batches_total", "KV event batches received per "
                                 "worker.", labels=["worker"])
        for url, n in self.event_batches().items():
            ev.add_metric([url], n)
        hist = _histogram("pdserve_conductor_decision_seconds", "Time to choose a placement (recent decisions).",
                          self.placement.decision_seconds)
        return [q, r, kv, blocks, dec, hist, ev, *self._refusals()]

    def _refusals(self) -> list[Metric]:
        """The false-refusal replay's verdicts (pdserve.conductor.refusal_replay), judged up to now."""
        replay = self.placement.refusals
        replay.resolve()
        verdicts = CounterMetricFamily("pdserve_conductor_refusal_verdicts_total", "Early rejections (429 slo) judged "
                                       "by the measured requests placed beside them: verdict false_refusal (one "
                                       "would have met the target), right, or unverified.",
                                       labels=["target", "verdict"])
        for (target, verdict), n in sorted(replay.counts.items()):
            verdicts.add_metric([target, verdict], n)
        out: list[Metric] = [verdicts]
        share = replay.share()
        if share is not None:
            g = GaugeMetricFamily("pdserve_conductor_false_refusal_ratio", "False refusals / (false + right) among "
                                  "the verified early rejections since start.")
            g.add_metric([], share)
            out.append(g)
        return out
