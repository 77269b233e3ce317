"""What the conductor decides: the request it places, its decision, and the bookkeeping of a placed request.

Kept apart from :mod:`.policy` (the deciding) so that :mod:`.view`, :mod:`.elastic` and the router can name decisions
without importing the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .load import WorkerLoad


class NoWorker(Exception):
    """No live worker can take the request (role given in ``role``)."""

    def __init__(self, role: str, message: str) -> None:
        super().__init__(message)
        self.role = role


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    prompt_tokens: int
    block_keys: Sequence[int] = ()
    max_tokens: int = 16
    whole: bool = False  # the whole request on one worker that decodes (beam search: vLLM's own loop over steps)


class Candidate(NamedTuple):
    """A worker the conductor weighed for one role of a placement: its predicted TTFT (``role`` "prefill": queue +
    the uncached prompt, with the prompt tokens it would not compute and where they load from) or TPOT ("decode")."""

    worker: str
    role: str
    predicted_s: float
    cached_tokens: int = 0
    fetch_tokens: int = 0
    fetch_tier: str = ""


@dataclass(frozen=True)
class Decision:
    kind: str  # "disaggregated" | "local" | "reject"
    request_id: str
    prefill: str | None = None
    decode: str | None = None
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    retry_after_s: float = 0.0
    reason: str = ""
    cached_tokens: int = 0  # prompt tokens the chosen prefill worker will not compute
    fetch_tokens: int = 0  # of those, tokens loaded from a fetchable holder (the pool)
    fetch_tier: str = ""  # the tier they load from (pdserve.conductor.tiers), "" when none
    code: str = ""  # a reject's cause: "slo" (a target would be missed) or "worker_limit" (every worker is full)
    placement: str = ""  # elastic pools: "colocated", "chunked" (into a decoding worker) or "split" (P -> D)
    # the recalibration factors ttft_s and tpot_s were multiplied by (:mod:`.recalibration`; 1: none)
    ttft_factor: float = 1.0
    tpot_factor: float = 1.0
    # decided once the cost model had learnt from the first live prefills (Recalibration.warmup): its error teaches
    # the recalibration; before, the model is still leaving its start-up fit and corrects that error itself
    settled: bool = True
    # the workers weighed and their predictions (the conductor policy's fixed-role placements; empty otherwise)
    candidates: tuple[Candidate, ...] = field(default=(), compare=False)


@dataclass
class PrefillOption:
    """How one request's prefill would run on ``worker``: predicted TTFT there, prompt tokens it would not compute
    (``cached``, of which ``fetched`` loaded from tier ``source``: its own host or disk offload, the pool, a store)
    and those it would (``new``)."""

    worker: WorkerLoad
    ttft_s: float
    cached: int
    fetched: int
    new: int
    source: str = ""


@dataclass
class Placed:
    """The conductor's record of a placed request, until it finishes: its decision, the worker computing its prompt
    and the one decoding it (they change with ``replace_decode`` and moves), and what the cost model has seen."""

    decision: Decision
    prefill_worker: str | None
    decode_worker: str | None
    prefill_done_at: float | None = None
    first_decode_seen: bool = False
