"""Per-worker load as the conductor sees it: its own accounting of what it placed (queued prefills in FIFO order,
decodes running or awaiting their KV) merged with what the worker last reported (vLLM /metrics), the latter
trusted only while fresh.

With several router replicas (``ConductorConfig.replicas`` > 1) each one places on the same workers, so what a
worker reports running and waiting beyond what this replica has there is the other replicas' load
(:class:`Others`, :meth:`WorkerLoad.merge_report`): counted in its queue, decode batch, in-flight count and load
order until the report goes stale. Each of the others' prefills is costed as this replica's own recent ones on that
worker (their sizes are not reported)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "both", "colocated", "elastic")


@dataclass
class PrefillJob:
    request_id: str
    new_tokens: int
    cached_tokens: int
    predicted_s: float
    enqueued_at: float


@dataclass
class DecodeJob:
    request_id: str
    context_tokens: int  # prompt + tokens produced so far
    remaining_tokens: int
    kv_tokens: int  # what the request may occupy at most: prompt + max_tokens
    started_at: float | None = None  # None until its prefill finished (KV not there yet)
    tokens_done: int = 0
    last_progress_at: float | None = None
    stalled_s: float = 0.0  # predicted prefill stalls the conductor placed next to it (elastic workers)

    @property
    def gaps(self) -> int:
        """Token gaps over its whole output (the TPOT denominator), at least 1."""
        return max(1, self.tokens_done + self.remaining_tokens - 1)


@dataclass
class Reported:
    """What the worker itself said (vLLM /metrics), at ``at`` (conductor clock)."""

    at: float
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1


@dataclass(frozen=True)
class Others:
    """The other replicas' requests on a worker at ``at``: its report less this replica's own there."""

    at: float
    prefills: int = 0  # queued or running prefills
    decodes: int = 0  # running decodes (and, on a decode worker, those waiting for their KV)


@dataclass
class WorkerLoad:
    worker_id: str
    role: str
    kv_capacity_tokens: int
    healthy: bool = True
    prefills: dict[str, PrefillJob] = field(default_factory=dict)  # insertion order = FIFO
    decodes: dict[str, DecodeJob] = field(default_factory=dict)
    last_prefill_end: float = float("-inf")
    reported: Reported | None = None
    others: Others | None = None  # only with router replicas (merge_report)
    mean_prefill_s: float = 0.0  # this replica's recent prefills here: the cost of one of the others'
    mean_prefill_tokens: float = 0.0

    @property
    def others_prefills(self) -> int:
        return self.others.prefills if self.others is not None else 0

    @property
    def others_decodes(self) -> int:
        return self.others.decodes if self.others is not None else 0

    def merge_report(self, at: float, waiting: int, running: int, typical: PrefillJob | None = None) -> None:
        """The worker reported ``waiting`` + ``running`` requests at ``at``: what exceeds this replica's own
        there (its queued prefills; its decodes whose KV is on the way or there) is the other replicas'. Their
        prefills cost what this replica's own here did lately, else what ``typical`` (its last anywhere) does."""
        own_prefills = [j for r, j in self.prefills.items() if r not in self.decodes]
        if not own_prefills and not self.mean_prefill_s and typical is not None:
            own_prefills = [typical]
        own_decodes = sum(1 for j in self.decodes.values() if j.started_at is not None)
        if own_prefills:  # the cost of one of the others' prefills
            self.mean_prefill_s = sum(j.predicted_s for j in own_prefills) / len(own_prefills)
            self.mean_prefill_tokens = sum(j.new_tokens for j in own_prefills) / len(own_prefills)
        mine = sum(1 for r in self.prefills if r not in self.decodes)
        if self.role == "prefill":
            self.others = Others(at, prefills=max(0, waiting + running - mine))
        elif self.role == "decode":
            self.others = Others(at, decodes=max(0, waiting + running - own_decodes))
        else:
            self.others = Others(at, prefills=max(0, waiting - mine),
                                 decodes=max(0, running - own_decodes))

    def expire_others(self, now: float, staleness_s: float) -> bool:
        """Forget the others' load once the report it came from is older than ``staleness_s`` (a worker that
        stopped answering, a replica that left: its requests no longer show); True when it did."""
        if self.others is None or now - self.others.at <= staleness_s:
            return False
        self.others = None
        return True

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both", "elastic")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both", "elastic")

    def queue_s(self, now: float) -> float:
        """Predicted seconds until a prefill enqueued now would start (work already queued here)."""
        total = 0.0
        start = self.last_prefill_end
        for i, job in enumerate(self.prefills.values()):
            if i == 0:
                began = max(job.enqueued_at, start)
                total += max(0.0, job.predicted_s - max(0.0, now - began))
            else:
                total += job.predicted_s
        return total + self.others_prefills * self.mean_prefill_s

    def queued_prefill_tokens(self) -> int:
        return sum(j.new_tokens for j in self.prefills.values()) + int(self.others_prefills * self.mean_prefill_tokens)

    def running_decodes(self) -> int:
        return len(self.decodes) + self.others_decodes

    def in_flight(self) -> int:
        """Requests placed here and not finished: queued prefills and decodes (one request counted once), the
        other replicas' included."""
        return (len(self.decodes) + sum(1 for r in self.prefills if r not in self.decodes) + self.others_prefills
                + self.others_decodes)

    def decode_batch_at(self, t: float, now: float, step_s: float) -> tuple[int, int]:
        """(batch, total context) of the decodes predicted to still run at time ``t``; decodes still waiting
        for their prefill count as running then."""
        batch, ctx = 0, 0.0
        for j in self.decodes.values():
            if j.started_at is None or now + j.remaining_tokens * step_s > t:
                batch += 1
                ctx += j.context_tokens + (max(0.0, t - now) / step_s if step_s > 0 else 0)
        if self.others_decodes:  # the other replicas' decodes, each as long as this replica's on average
            ctx += self.others_decodes * (ctx / batch if batch else 0.0)
            batch += self.others_decodes
        return batch, int(ctx)

    def kv_used_tokens(self, now: float, staleness_s: float) -> int:
        own = sum(j.kv_tokens for j in self.decodes.values()) + sum(
            j.new_tokens + j.cached_tokens for r, j in self.prefills.items() if r not in self.decodes)
        r = self.reported
        if r is not None and now - r.at <= staleness_s:
            return max(own, int(r.kv_usage * self.kv_capacity_tokens))
        return own
