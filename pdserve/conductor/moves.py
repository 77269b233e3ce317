"""Moving running decodes off a worker that starts a long prefill.

When the conductor places a prefill on an elastic worker w (colocated, chunked, or the P of a split) and w has
decodes running, each of them would be stalled by that prefill: for its predicted seconds in one step, or, chunked
into w's decode steps, by one chunk's compute in each of those steps (:func:`stall_s`). A running decode may
instead **move** to another worker d. A move is a P -> D hand-off of the decode's context: the router stops
reading it on w (vLLM aborts it there), asks w to prefill ``prompt + the tokens streamed so far`` with
``max_tokens=1`` (w's prefix cache holds every full block of that context: only the last, partial block is
computed) and hands its KV to d through the connector, exactly as a split request's P -> D. Its cost
(:func:`move_cost_s`) is the hand-off's fixed cost + the KV transfer of the whole context + that tail prefill.

A decode moves when the stall it would suffer is larger than its move's cost, plus what its tail prefill delays the
new prefill (it runs first on w: :func:`tail_s`), plus ``min_gain_s``, and a worker takes it: live, elastic, not w,
not itself prefilling a long prompt, below the in-flight limit, with KV room for the context and the tokens left;
of those the one with the lowest predicted TPOT. Decodes that gain the most
move first, at most ``max_moves`` per placed prefill; each move is recorded in the load view at once
(:func:`apply_move`), so the next destination and every later decision see it.

The conductor stays the one owner of placement: a move replaces the request's placement with a split
(P = w for the tail, D = d) whose prefill job is put before w's queued prefills (the router runs it first).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from .decision import Decision, PlacementRequest
from .elastic import prefilling_long, step_budget
from .load import DecodeJob, PrefillJob, WorkerLoad
from .policy import Conductor
from .view import FleetView

log = logging.getLogger("pdserve.conductor")


@dataclass(frozen=True)
class MoveConfig:
    """enabled: move running decodes off a worker that starts a prefill when it pays (elastic pools only).
    min_gain_s: a decode moves only when its predicted stall exceeds its move's cost by more than this.
    max_moves: at most this many decodes move per placed prefill.
    wait_s: the placed prefill waits at most this long for its moves' tail prefills on the same worker (the
        router sends it after them, so that vLLM does not queue them behind it)."""

    enabled: bool = True
    min_gain_s: float = 0.0
    max_moves: int = 8
    wait_s: float = 2.0

    def __post_init__(self) -> None:
        if self.min_gain_s < 0 or not math.isfinite(self.min_gain_s):
            raise ValueError(f"min_gain_s={self.min_gain_s!r}: seconds >= 0")
        if isinstance(self.max_moves, bool) or not isinstance(self.max_moves, int) or self.max_moves < 0:
            raise ValueError(f"max_moves={self.max_moves!r}: a count >= 0 (0 moves nothing)")
        if self.wait_s < 0 or not math.isfinite(self.wait_s):
            raise ValueError(f"wait_s={self.wait_s!r}: seconds >= 0")


@dataclass(frozen=True)
class Move:
    request_id: str
    src: str  # the worker that starts the prefill (the decode's worker until now; it prefills the tail)
    dst: str  # the worker the decode continues on
    context_tokens: int  # prompt + tokens produced so far: what moves
    remaining_tokens: int
    stall_s: float  # what staying would cost the decode
    cost_s: float  # what moving costs it
    reason: str = ""


def tail_tokens(context: int, block_size: int) -> int:
    """Tokens the source computes again for a move: the last, partial block (vLLM reuses whole cached blocks and
    computes at least the last token)."""
    if context <= 0:
        return 0
    return context - (context - 1) // block_size * block_size


def move_cost_s(c: FleetView, context: int) -> float:
    """Predicted cost of moving a decode with ``context`` tokens: hand-off + KV transfer + the tail prefill."""
    cost = c.cost
    tail = tail_tokens(context, c.config.block_size)
    return (cost.handoff_s + cost.transfer_s(context * cost.kv_bytes_per_token)
            + cost.prefill_s(tail, context - tail))


def tail_s(c: FleetView, context: int) -> float:
    """Predicted seconds of a move's tail prefill on the source: what it delays the prefill placed there."""
    tail = tail_tokens(context, c.config.block_size)
    return c.cost.prefill_s(tail, context - tail)


def stall_s(c: FleetView, w: WorkerLoad, job: PrefillJob) -> float:
    """What the prefill ``job`` adds to each of w's running decodes: its compute in one step, or chunked into w's
    decode steps, one chunk's compute (the last chunk, with the most context) in each of them."""
    running = sum(1 for j in w.decodes.values() if j.request_id != job.request_id)  # not its own decode
    budget = step_budget(c, running)
    whole = c.cost.prefill_s(job.new_tokens, job.cached_tokens)
    if budget is None or job.new_tokens <= budget or not running:
        return whole
    steps = math.ceil(job.new_tokens / budget)
    return steps * c.cost.prefill_s(budget, job.cached_tokens + job.new_tokens - budget)


def _destinations(c: FleetView, src: WorkerLoad, req: PlacementRequest, now: float) -> list[WorkerLoad]:
    limit = c.config.max_inflight_per_worker
    return [d for d in c.workers.values()
            if d.healthy and d.role == "elastic" and d is not src and not prefilling_long(c, d)
            and (limit is None or d.in_flight() < limit) and c.fits(d, req, now)]


def plan_moves(c: Conductor, request_id: str, config: MoveConfig,
               can_move: Callable[[str, str], bool] = lambda rid, src: True) -> list[Move]:
    """The moves that pay now that ``request_id``'s prefill is placed, each applied to the load view as it is
    chosen (:func:`apply_move`). ``can_move(request_id, src)``: whether the router can move that decode now (it
    is streaming from src); one it cannot is left where it is."""
    prefill_worker = c.prefill_worker_of(request_id)
    if not config.enabled or config.max_moves == 0 or prefill_worker is None:
        return []
    w = c.workers.get(prefill_worker)
    job = w.prefills.get(request_id) if w is not None else None
    if w is None or job is None or w.role != "elastic":
        return []
    log.debug("prefill of %s on %s, which runs decodes %s", request_id, w.worker_id,
              sorted(j.request_id for j in w.decodes.values()))
    stall = stall_s(c, w, job)
    now = c.clock()
    ranked = []
    for j in w.decodes.values():
        if j.request_id == request_id or j.started_at is None or j.remaining_tokens < 2:
            continue  # the prefill's own decode, one whose KV is not there yet, or one about to end
        cost = move_cost_s(c, j.context_tokens)
        if stall > cost + tail_s(c, j.context_tokens) + config.min_gain_s:
            ranked.append((cost - stall, j.request_id, j, cost))
        else:
            log.debug("prefill of %s on %s: decode %s stays (stall %.0f ms, move %.0f ms)", request_id,
                      w.worker_id, j.request_id, stall * 1e3, cost * 1e3)
    moves: list[Move] = []
    for _, rid, j, cost in sorted(ranked, key=lambda x: (x[0], x[1])):
        if len(moves) >= config.max_moves:
            break
        req = PlacementRequest(rid, j.context_tokens, (), j.remaining_tokens)
        dests = _destinations(c, w, req, now)
        if not dests or not can_move(rid, w.worker_id):
            log.debug("prefill of %s on %s: decode %s stays (%s)", request_id, w.worker_id, rid,
                      "no worker takes it" if not dests else "the router cannot move it now")
            continue
        d = min(dests, key=lambda x: (c.tpot_s(x, now, now, req), x.worker_id))
        m = Move(rid, w.worker_id, d.worker_id, j.context_tokens, j.remaining_tokens, stall, cost,
                 f"move off {w.worker_id}: a stall of {stall * 1e3:.0f} ms > a move of {cost * 1e3:.0f} ms "
                 f"({j.context_tokens} tokens of context to {d.worker_id})")
        apply_move(c, m)
        moves.append(m)
    return moves


def apply_move(c: Conductor, m: Move) -> Decision:
    """Record ``m`` in the load view: the request's placement becomes a split, P = m.src for the tail (put first in
    src's prefill queue), D = m.dst; its old placement is released. Returns the new decision."""
    c.finished(m.request_id)
    tail = tail_tokens(m.context_tokens, c.config.block_size)
    cached = m.context_tokens - tail
    dst = c.workers[m.dst]
    now = c.clock()
    tail_s = c.cost.prefill_s(tail, cached)
    d = Decision("disaggregated", m.request_id, m.src, m.dst, ttft_s=tail_s,
                 tpot_s=c.tpot_s(dst, now, now, PlacementRequest(m.request_id, m.context_tokens, (),
                                                                  m.remaining_tokens)),
                 cached_tokens=cached, reason=m.reason)
    c.record(d, PrefillJob(m.request_id, tail, cached, tail_s, now),
             DecodeJob(m.request_id, m.context_tokens, m.remaining_tokens, m.context_tokens + m.remaining_tokens),
             first=True)
    return d
