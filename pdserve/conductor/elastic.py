"""Elastic roles: every worker may prefill, decode, or both, chosen per request (issue 16, item 1).

Workers of role ``elastic`` run pdserve's connector as ``kv_both`` and have no fixed role. For each request the
conductor (policy ``conductor``) weighs three kinds of option over the live workers below their in-flight limit
(the decision's ``placement`` and the ``placements`` counter name them):

- **colocated** on w (kind ``local``): prefill and decode on w, the prefill in one step: w runs no decode, or
  the uncached prompt fits in the step's token budget. TTFT = queue(w) + fetch + prefill (+ one decode step
  when w is decoding, as for decode-local).
- **chunked** on w (kind ``local``): w is decoding and the prompt is longer than its step budget
  (``chunk_tokens`` = vLLM's ``--max-num-batched-tokens``, less one token per running decode: vLLM V1
  schedules the decodes first and fills the step with prefill tokens). The prefill runs in
  ceil(new / budget) steps shared with w's decodes: TTFT = queue + fetch + prefill + that many decode steps,
  and each of w's decodes is slowed per step by one chunk's compute (the last chunk, the one with the most
  context) instead of being stalled once for the whole prefill.
- **split** P=p, D=d (kind ``disaggregated``, p != d): the existing P -> D hand-off. TTFT on p as above (a
  prefill on a decoding p is chunked there too); D is the worker with the lowest TPOT predicted at the moment
  p's prefill ends, among those with KV room.

Every option also carries its **harm**: the prefill's compute delays each decode already running on the worker
that computes it, so harm = predicted prefill seconds x running decodes there. Chunking spreads the same compute
over more steps, so it keeps the harm and bounds the per-token gap instead: with a TPOT target, an option whose
prefill makes its worker's running decodes' step (decode step + the per-step stall) miss the target is dropped.
An option's cost is TTFT + harm (the delay it adds for the new request and for everyone it slows). The lowest
cost chooses the worker that prefills; colocated/chunked on w and split with P=w cost the same, and the kind
preferred for that prompt on w breaks the tie. Split options are built for the ``SPLIT_CANDIDATES`` cheapest
prefill workers only (the decision stays linear in workers).

A prefill is **long** on w when the stall it puts on a decode there is: with chunking on a decoding w, when one
chunk's compute is over ``local_stall_s``; otherwise when the uncached prompt is over ``local_prefill_tokens``
(when set) or its predicted prefill is over both ``local_stall_s`` and the hand-off (fixed cost + KV transfer)
a split would add. Long prefills prefer split: the decode goes to another worker, so the prefilling worker stays
free of decodes and the next long prefill there stalls nobody (Splitwise's mixed pool). Short ones prefer to
keep the decode where the prefill runs (colocated, or chunked into a decoding worker): no hand-off, and the
stall is small. A worker with a long prefill queued or running gets **no new decode** (neither colocated nor as
D) while another worker can take it.

Options that miss the TTFT/TPOT target (or, with a TPOT target, find no KV room) are dropped; with none left the
request is rejected (429 + Retry-After), exactly as the fixed-role conductor does.

Not built: moving a worker's running decodes off it when it starts a long prefill (the KV would move through
the connector as in a P -> D hand-off; it needs the router's streaming path to switch a live stream).

The baselines (``round_robin``, ``least_loaded``) place whole requests, as on colocated workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .decision import Decision, PlacementRequest, _Option
from .load import WorkerLoad

if TYPE_CHECKING:
    from .policy import Conductor


SPLIT_CANDIDATES = 4  # split options are built for this many prefill workers, the cheapest ones


@dataclass(frozen=True)
class Prefill:
    """How a prefill would run on one worker (``option``'s), among the decodes already running there."""

    option: _Option
    ttft_s: float  # queue + fetch + prefill + the decode part of every step it shares
    harm_s: float  # prefill seconds x running decodes there
    steps: int  # steps it spans (1 unless chunked into a decoding worker)
    stall_s: float  # what it adds to each of those steps for the running decodes (0 when there are none)
    step_s: float  # the running decodes' step time while it runs (their TPOT then; 0 when there are none)

    @property
    def chunked(self) -> bool:
        return self.steps > 1

    @property
    def cost_s(self) -> float:
        return self.ttft_s + self.harm_s


@dataclass(frozen=True)
class _Candidate:
    rank: int  # 0: the preferred kind for this prefill (split when long, colocated/chunked when short)
    cost: float  # ttft + harm
    ids: tuple[str, ...]  # (prefill worker, decode worker) or (worker,): the tie-break
    decision: Decision
    fits: bool
    prefill: Prefill


def step_budget(c: Conductor, running: int) -> int | None:
    """Prefill tokens one step of a worker running ``running`` decodes can take; None when unknown."""
    chunk = c.config.chunk_tokens
    return None if chunk is None else max(1, chunk - running)


def prefill_on(c: Conductor, o: _Option) -> Prefill:
    """o's prefill on its worker: one step, or chunked into the worker's decode steps."""
    w = o.worker
    n = w.running_decodes()
    if not n:
        return Prefill(o, o.ttft_s, 0.0, 1, 0.0, 0.0)
    cost = c.cost
    decode_s = cost.decode_step_s(n, sum(j.context_tokens for j in w.decodes.values()))
    whole = cost.prefill_s(o.new, o.cached)
    budget = step_budget(c, n)
    if budget is None or o.new <= budget:
        steps, stall = 1, whole
    else:  # vLLM fills each step with `budget` prompt tokens; the last chunk attends to the most context
        steps, stall = math.ceil(o.new / budget), cost.prefill_s(budget, o.cached + o.new - budget)
    return Prefill(o, o.ttft_s + steps * decode_s, whole * n, steps, stall, decode_s + stall)


def is_long(c: Conductor, new_tokens: int, cached_tokens: int) -> bool:
    """A prefill that stalls the decodes batched with it for longer than ``local_stall_s`` and longer than a
    hand-off (fixed cost + KV transfer) would delay the request itself; or, when ``local_prefill_tokens`` is
    set, one over that many uncached tokens."""
    thr = c.config.local_prefill_tokens
    if thr is not None:
        return new_tokens > thr
    cost = c.cost
    hand = cost.handoff_s + cost.transfer_s((new_tokens + cached_tokens) * cost.kv_bytes_per_token)
    return cost.prefill_s(new_tokens, cached_tokens) > max(c.config.local_stall_s, hand)


def _is_long_on(c: Conductor, w: WorkerLoad, new_tokens: int, cached_tokens: int) -> bool:
    """Long for a decode on w: chunked into w's decodes, one chunk stalls them for over ``local_stall_s``."""
    budget = step_budget(c, w.running_decodes())
    if w.running_decodes() and budget is not None and new_tokens > budget:
        return c.cost.prefill_s(budget, cached_tokens + new_tokens - budget) > c.config.local_stall_s
    return is_long(c, new_tokens, cached_tokens)


def prefilling_long(c: Conductor, w: WorkerLoad) -> bool:
    """w has a long prefill queued or running: it takes no new decode while another worker can."""
    return any(_is_long_on(c, w, j.new_tokens, j.cached_tokens) for j in w.prefills.values())


def place(c: Conductor, req: PlacementRequest, ws: list[WorkerLoad]) -> Decision:
    """The conductor's elastic decision among ``ws`` (live, below the in-flight limit, at least one)."""
    now = c.clock()
    prefix = c.index.prefix_lengths(req.block_keys)
    shapes = {o.worker.worker_id: prefill_on(c, o) for o in c._prefill_options(req, ws, prefix, now)}
    decoders = [w for w in ws if not prefilling_long(c, w)] or ws
    cands = [_colocated(c, req, shapes[w.worker_id], now) for w in decoders]
    # a split with P=p costs what colocated on p costs: only the cheapest few P can win (linear, not quadratic)
    cheapest = sorted(ws, key=lambda w: (shapes[w.worker_id].cost_s, w.worker_id))[:SPLIT_CANDIDATES]
    for p in cheapest:
        split = _split(c, req, shapes[p.worker_id], [d for d in decoders if d is not p], now)
        if split is not None:
            cands.append(split)
    ok = [x for x in cands if _meets(c, x)]
    if ok:
        return min(ok, key=_order).decision
    top = min(cands, key=_order)
    rej = c._reject_reason(top.decision, decoders, fits=top.fits) or _reject_stall(c, top, now)
    return rej if rej is not None else top.decision


def _order(x: _Candidate) -> tuple[bool, float, int, tuple[str, ...]]:
    """KV room first (vLLM would queue the rest), then the lowest cost, the preferred kind, the worker ids."""
    return (not x.fits, x.cost, x.rank, x.ids)


def _colocated(c: Conductor, req: PlacementRequest, s: Prefill, now: float) -> _Candidate:
    o, w = s.option, s.option.worker
    long = _is_long_on(c, w, o.new, o.cached)
    kind = "chunked" if s.chunked else "colocated"
    n = w.running_decodes()
    if s.chunked:
        how = (f"in {s.steps} steps of <= {step_budget(c, n)} tokens, slows {n} running decode(s) by "
               f"{s.stall_s * 1e3:.0f} ms per step ({s.step_s * 1e3:.0f} ms per token)")
    else:
        how = f"stalls {n} running decode(s) by {s.stall_s * 1e3:.0f} ms"
    d = Decision("local", req.request_id, None, w.worker_id, ttft_s=s.ttft_s,
                 tpot_s=c._tpot(w, now, now + s.ttft_s, req), cached_tokens=o.cached, fetch_tokens=o.fetched,
                 reason=f"elastic {kind} on {w.worker_id}: {o.new} uncached prompt tokens "
                        f"({'long' if long else 'short'}), {how}", placement=kind)
    return _Candidate(1 if long else 0, s.cost_s, (w.worker_id,), d, c._fits(w, req, now), s)


def _split(c: Conductor, req: PlacementRequest, s: Prefill, decode: list[WorkerLoad], now: float
           ) -> _Candidate | None:
    if not decode:
        return None
    o, p = s.option, s.option.worker
    long = _is_long_on(c, p, o.new, o.cached)
    at = now + s.ttft_s
    fitting = [d for d in decode if c._fits(d, req, now)]
    tpots = {d.worker_id: c._tpot(d, now, at, req) for d in (fitting or decode)}
    d_id = min(tpots, key=lambda wid: (tpots[wid], wid))
    chunks = f" in {s.steps} chunked steps" if s.chunked else ""
    dec = Decision("disaggregated", req.request_id, p.worker_id, d_id, ttft_s=s.ttft_s, tpot_s=tpots[d_id],
                   cached_tokens=o.cached, fetch_tokens=o.fetched,
                   reason=f"elastic split: prefill {o.new} uncached tokens ({'long' if long else 'short'}) on "
                          f"{p.worker_id}{chunks} ({p.running_decodes()} running decode(s)), decode on {d_id}"
                          + ("" if fitting else "; no decode worker has KV room"), placement="split")
    return _Candidate(0 if long else 1, s.cost_s, (p.worker_id, d_id), dec, bool(fitting), s)


def _meets(c: Conductor, x: _Candidate) -> bool:
    cfg = c.config
    d = x.decision
    if cfg.ttft_slo_s is not None and d.ttft_s > cfg.ttft_slo_s:
        return False
    if cfg.tpot_slo_s is not None and (d.tpot_s > cfg.tpot_slo_s or not x.fits or x.prefill.step_s > cfg.tpot_slo_s):
        return False
    return True


def _reject_stall(c: Conductor, x: _Candidate, now: float) -> Decision | None:
    """The best option meets the targets for the new request but slows the prefilling worker's running decodes
    past the TPOT target: reject, retry when the first of them is predicted to finish."""
    slo = c.config.tpot_slo_s
    s = x.prefill
    if slo is None or s.step_s <= slo:
        return None
    w = s.option.worker
    d = x.decision
    return Decision("reject", d.request_id, d.prefill, d.decode, ttft_s=d.ttft_s, tpot_s=d.tpot_s,
                    retry_after_s=float(max(1, math.ceil(c._drain_s(w, now)))),
                    reason=f"prefilling on {w.worker_id} would slow its {w.running_decodes()} running decode(s) to "
                           f"{s.step_s * 1e3:.1f} ms per token > TPOT target {slo * 1e3:.1f} ms", code="slo")
