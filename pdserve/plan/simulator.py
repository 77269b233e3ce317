"""Discrete-event simulation of a pdserve cluster, placing every request with the real conductor policy.

Events: arrivals, engine-step ends, hand-overs (KV transfer done + router hand-off). The conductor
(:class:`pdserve.conductor.policy.Conductor`) gets the simulated clock, the workers, their prefix-cache events
and the request lifecycle exactly as the router would feed it, and decides local / disaggregated / reject."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.conductor.config import ConductorConfig
from pdserve.conductor.cost_model import CostModel
from pdserve.conductor.policy import Conductor, NoWorker, PlacementRequest

from ..settings.errors import ConfigError
from .results import Targets, summarize
from .traffic import Request
from .worker import Job, SimWorker


@dataclass(frozen=True)
class Cluster:
    """Worker counts of one configuration; each worker (instance) spans ``devices_per_worker`` devices.

    One shape per cluster: ``colocated`` workers (whole requests), ``prefill`` + ``decode`` workers (xPyD, every
    request handed over), or ``elastic`` workers (no fixed role: the conductor places each request colocated on
    one of them or split P -> D between two, :mod:`pdserve.conductor.elastic`)."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    devices_per_worker: int = 1
    elastic: int = 0

    def __post_init__(self) -> None:
        counts = {"colocated": self.colocated, "prefill": self.prefill, "decode": self.decode,
                  "elastic": self.elastic, "devices_per_worker": self.devices_per_worker}
        bad = [f"{k}={v!r}" for k, v in counts.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad or self.devices_per_worker < 1:
            raise ConfigError(f"worker counts must be whole numbers >= 0 and devices_per_worker >= 1, got "
                             f"{', '.join(bad) or f'devices_per_worker={self.devices_per_worker}'}")
        shapes = [name for name, on in (("colocated", self.colocated), ("elastic", self.elastic),
                                        ("prefill + decode", self.prefill or self.decode)) if on]
        if len(shapes) > 1:
            raise ConfigError(f"a cluster is one shape: colocated workers, elastic workers, or prefill + decode "
                             f"workers; got {' and '.join(shapes)} (e.g. colocated:4, elastic:4 or 2P2D)")
        if not shapes or (shapes == ["prefill + decode"] and not (self.prefill and self.decode)):
            raise ConfigError("give colocated >= 1, elastic >= 1, or prefill >= 1 and decode >= 1 "
                             f"(got prefill={self.prefill}, decode={self.decode})")

    @property
    def kind(self) -> str:
        """"colocated", "elastic" or "pd"."""
        return "colocated" if self.colocated else "elastic" if self.elastic else "pd"

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated x{self.colocated}"
        if self.elastic:
            return f"elastic x{self.elastic}"
        return f"{self.prefill}P{self.decode}D"

    @property
    def devices(self) -> int:
        return (self.colocated + self.prefill + self.decode + self.elastic) * self.devices_per_worker

    def roles(self) -> list[tuple[str, str]]:
        if self.colocated:
            return [(f"c{i}", "colocated") for i in range(self.colocated)]
        if self.elastic:
            return [(f"e{i}", "elastic") for i in range(self.elastic)]
        return [(f"p{i}", "prefill") for i in range(self.prefill)] + [(f"d{i}", "decode") for i in range(self.decode)]


def config_kind(label: str) -> str:
    """The shape of a configuration label: "colocated", "elastic" or "pd"."""
    return "colocated" if label.startswith("colocated") else "elastic" if label.startswith("elastic") else "pd"


HANDOFFS = ("early", "layerwise", "serial")  # SimSettings.handoff, pdserve plan --handoff


@dataclass(frozen=True)
class SimSettings:
    """policy: the conductor policy (round_robin | least_loaded | conductor).
    chunk_tokens: per-step token budget (vLLM max_num_batched_tokens); max_seqs: vLLM max_num_seqs.
    reject: give the targets to the conductor so it rejects requests predicted to miss them.
    handoff: PD's hand-off (:data:`HANDOFFS`). layerwise (the default, what pdserve's connector does: from a GPU's
    memory once each layer's kernels ran, pdserve.vllm.fence, not yet run on a GPU): early dispatch (D admits the
    request when it is placed) and each layer's KV leaving P as P computes it; early: early dispatch, the whole KV
    after P's prefill (layerwise_kv off); serial: the whole prefill, then the whole transfer, then the router's
    hand-off to D.
    :func:`handoff_ready_s` says how."""

    targets: Targets
    policy: str = "round_robin"
    chunk_tokens: int = 8192
    max_seqs: int = 256
    block_size: int = 128
    kv_capacity_tokens: int = 1 << 20
    reject: bool = False
    progress_every: int = 4  # tokens between decode_progress calls to the conductor
    handoff: str = "layerwise"  # layerwise | early | serial (docs/plan.md "The hand-off")

    def __post_init__(self) -> None:
        if self.handoff not in HANDOFFS:
            raise ConfigError(f"handoff {self.handoff!r}: use one of {', '.join(HANDOFFS)}")


class Simulation:
    def __init__(self, cluster: Cluster, cost: CostModel, settings: SimSettings) -> None:
        if cluster.elastic and settings.policy != "conductor":
            raise ConfigError(f"{cluster.label}: elastic workers get their role per request from the conductor "
                             f"policy; with policy {settings.policy!r} they would be colocated workers "
                             "(use --policy conductor, or simulate colocated:N)")
        self.cluster, self.cost, self.settings = cluster, cost, settings
        self.now = 0.0
        s = settings
        self.conductor = Conductor(
            ConductorConfig(policy=s.policy, block_size=s.block_size,
                            ttft_slo_s=s.targets.ttft_s if s.reject else None,
                            tpot_slo_s=s.targets.tpot_s if s.reject else None,
                            chunk_tokens=s.chunk_tokens),
            cost, clock=lambda: self.now)
        self.workers: dict[str, SimWorker] = {}
        for wid, role in cluster.roles():
            self.workers[wid] = SimWorker(wid, role, cost, s.kv_capacity_tokens, s.chunk_tokens, s.max_seqs,
                                          s.block_size)
            self.conductor.add_worker(wid, role, s.kv_capacity_tokens)
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._plans: dict[str, Any] = {}
        self._link_free: dict[str, float] = {}
        self.transfers: list[tuple[int, float, float]] = []  # (bytes, seconds, seconds after P's last step)
        self.layers = max(1, int(getattr(cost, "layers", 1)))  # KV layers: layer-wise transfer's granularity
        self.jobs: list[Job] = []

    # ---- events ----
    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, requests: Sequence[Request]) -> dict[str, Any]:
        jobs = self.jobs = [Job(r) for r in requests]
        for job in jobs:
            self._push(job.req.arrival_s, "arrive", job)
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = t
            if kind == "arrive":
                self._arrive(payload)
            elif kind == "step":
                self._step_end(self.workers[payload])
            else:
                self._handed_over(payload)
        return self._summary(jobs)

    def _arrive(self, job: Job) -> None:
        r = job.req
        try:
            d = self.conductor.place(PlacementRequest(r.rid, r.prompt_tokens, r.block_keys, r.output_tokens))
        except NoWorker as exc:
            job.rejected = str(exc)
            return
        if d.kind == "reject":
            job.rejected = d.reason or "rejected"
            return
        job.kind = d.kind
        job.decode_worker = d.decode or ""
        job.prefill_worker = (d.prefill or "") if d.kind == "disaggregated" else job.decode_worker
        w = self.workers[job.prefill_worker]
        w.waiting.append(job)
        self._kick(w)

    def _kick(self, w: SimWorker) -> None:
        if w.busy_until is not None:
            return
        plan = w.plan_step()
        if plan is None:
            return
        w.busy_until = self.now + plan.seconds
        for job, _ in plan.chunks:
            if job.prefill_start_s is None:
                job.prefill_start_s = self.now
        self._plans[w.wid] = plan
        self._push(w.busy_until, "step", w.wid)

    def _step_end(self, w: SimWorker) -> None:
        plan = self._plans.pop(w.wid)
        w.busy_s += plan.seconds
        w.steps += 1
        w.busy_until = None
        for job, n in plan.chunks:
            job.computed += n
            if job.prefill_left <= 0:
                self._prefill_finished(w, job)
        for job in plan.decodes:
            self._token(w, job)
        self._kick(w)

    def _prefill_finished(self, w: SimWorker, job: Job) -> None:
        w.waiting.remove(job)
        self._store(w, job)
        self.conductor.prefill_done(job.req.rid, job.cached)
        job.tokens = 1
        job.first_token_s = job.last_token_s = self.now
        if job.kind == "disaggregated":
            w.release(job, with_output=False)
            if job.req.output_tokens <= 1:
                self._finish(None, job)
                return
            nbytes = int(self._kv_bytes(job.req.prompt_tokens))
            secs = self.cost.transfer_s(nbytes)
            landed, ready = handoff_ready_s(self.cost, nbytes, self._handoff_layers(), self.now,
                                            job.prefill_start_s or self.now, job.req.arrival_s,
                                            self._link_free.get(w.wid, 0.0))
            self._link_free[w.wid] = landed
            self.transfers.append((nbytes, secs, landed - self.now))
            self._push(ready, "handover", job)
        elif job.req.output_tokens <= 1:
            self._finish(w, job)
        else:
            w.running.append(job)
            self.conductor.decode_progress(job.req.rid, 1)

    def _handed_over(self, job: Job) -> None:
        d = self.workers[job.decode_worker]
        d.incoming.append(job)
        self.conductor.decode_progress(job.req.rid, 1)
        self._kick(d)

    def _token(self, w: SimWorker, job: Job) -> None:
        job.tokens += 1
        job.gaps.append(self.now - job.last_token_s)
        job.last_token_s = self.now
        if job.tokens >= job.req.output_tokens:
            self._store(w, job)
            self._finish(w, job)
        elif job.tokens == 2 or job.tokens % self.settings.progress_every == 0:
            self.conductor.decode_progress(job.req.rid, job.tokens)

    def _finish(self, w: SimWorker | None, job: Job) -> None:
        job.done_s = self.now
        if w is not None:
            if job in w.running:
                w.running.remove(job)
            w.release(job)
        self.conductor.finished(job.req.rid)

    def _store(self, w: SimWorker, job: Job) -> None:
        stored, evicted = w.store(job.req.block_keys)
        if evicted:
            self.conductor.blocks_removed(w.wid, evicted)
        if stored:
            self.conductor.blocks_stored(w.wid, stored)

    def _handoff_layers(self) -> int:
        """:func:`handoff_ready_s`'s ``layers`` for the configured hand-off: the model's KV layers (layer-wise), one
        batch after the prefill with early dispatch (early), 0 (serial)."""
        return {"layerwise": self.layers, "early": 1, "serial": 0}[self.settings.handoff]

    def _kv_bytes(self, tokens: int) -> float:
        exact = getattr(self.cost, "kv_bytes", None)
        return exact(tokens) if exact is not None else tokens * self.cost.kv_bytes_per_token

    def _summary(self, jobs: list[Job]) -> dict[str, Any]:
        makespan = max((j.done_s for j in jobs if j.done_s is not None), default=0.0)
        busy: dict[str, list[tuple[float, float]]] = {}
        for w in self.workers.values():
            busy.setdefault(w.role, []).append((w.busy_s, makespan))
        out = summarize(jobs, self.settings.targets, busy)
        out["config"] = self.cluster.label
        out["devices"] = self.cluster.devices
        out["policy"] = self.settings.policy
        out["decisions"] = dict(self.conductor.counts)
        if self.cluster.elastic:  # where the split requests' prefills ran (the pool's emergent prefill workers)
            split = [j.prefill_worker for j in jobs if j.kind == "disaggregated"]
            out["split_prefills"] = {w: split.count(w) for w in self.workers if w in split}
        if self.transfers:
            n = len(self.transfers)
            moving, exposed = sum(s for _, s, _ in self.transfers), sum(e for _, _, e in self.transfers)
            out["transfer"] = {"count": n, "mean_bytes": sum(b for b, _, _ in self.transfers) / n,
                               "mean_s": moving / n, "mean_exposed_s": exposed / n,
                               "hidden_share": max(0.0, 1.0 - exposed / moving) if moving > 0 else None,
                               "handoff_s": self.cost.handoff_s, "handoff": self.settings.handoff,
                               "layers": self.layers}
        return out


def handoff_ready_s(cost: CostModel, nbytes: int, layers: int, now: float, prefill_start: float, placed: float,
                    link_free: float) -> tuple[float, float]:
    """(when the last KV byte lands on D, when D may run the request's first step) for a request whose prefill
    ended ``now`` on P.

    Sequential (``layers`` 0): the transfer starts once P has finished and the link is free; the router's hand-off
    (``cost.handoff_s``: the request's second HTTP trip, D's intake and scheduling) follows it.
    Overlapped (``layers`` L >= 1): each layer's KV is one batch of ``transfer_s(nbytes / L)`` that leaves as P
    computes it, spread evenly over P's prefill (from its first chunk's step, ``prefill_start``); the last layer's
    can only leave when P ends, so at least one layer's transfer stays exposed, and the rest hides behind the
    prefill while the link keeps up. D got the request when it was ``placed`` (early dispatch), so its intake runs
    beside P's prefill: D is ready at the later of the last layer's landing and ``placed + handoff_s``."""
    if layers <= 0:
        landed = max(now, link_free) + cost.transfer_s(nbytes)
        return landed, landed + cost.handoff_s
    per_layer = cost.transfer_s(nbytes / layers)  # type: ignore[arg-type]
    landed = max(now + per_layer, max(prefill_start, link_free) + layers * per_layer)
    return landed, max(landed, placed + cost.handoff_s)


def simulate(cluster: Cluster, cost: CostModel, settings: SimSettings, requests: Sequence[Request]
             ) -> dict[str, Any]:
    """Run ``requests`` through ``cluster``; summary as in :func:`pdserve.plan.results.summarize`."""
    return Simulation(cluster, cost, settings).run(requests)
