"""Per-worker load as the conductor sees it: its own accounting of what it placed (queued prefills in FIFO order,
decodes running or awaiting their KV) merged with what the worker last reported (vLLM /metrics), the latter
trusted only while fresh."""

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
        return total

    def queued_prefill_tokens(self) -> int:
        return sum(j.new_tokens for j in self.prefills.values())

    def running_decodes(self) -> int:
        return len(self.decodes)

    def in_flight(self) -> int:
        """Requests placed here and not finished: queued prefills and decodes (one request counted once)."""
        return len(self.decodes) + sum(1 for r in self.prefills if r not in self.decodes)

    def decode_batch_at(self, t: float, now: float, step_s: float) -> tuple[int, int]:
        """(batch, total context) of the decodes predicted to still run at time ``t``; decodes still waiting
        for their prefill count as running then."""
        batch, ctx = 0, 0.0
        for j in self.decodes.values():
            if j.started_at is None or now + j.remaining_tokens * step_s > t:
                batch += 1
                ctx += j.context_tokens + (max(0.0, t - now) / step_s if step_s > 0 else 0)
        return batch, int(ctx)

    def kv_used_tokens(self, now: float, staleness_s: float) -> int:
        own = sum(j.kv_tokens for j in self.decodes.values()) + sum(
            j.new_tokens + j.cached_tokens for r, j in self.prefills.items() if r not in self.decodes)
        r = self.reported
        if r is not None and now - r.at <= staleness_s:
            return max(own, int(r.kv_usage * self.kv_capacity_tokens))
        return own
