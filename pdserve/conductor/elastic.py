"""Elastic roles: every worker may prefill, decode, or both, chosen per request.

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
that computes it. harm = predicted prefill seconds x the sum, over those decodes, of their *inflation*
1 + (stalls already placed next to it) / (its output's plain decode time, gaps x decode step): a decode that has
not been stalled counts 1, one whose TPOT earlier prefills already stretched counts more, so the next long
prefill goes to the worker whose decodes can still afford it rather than hitting the same decodes again. (Each
decision charges its prefill's stall, steps x per-step stall, to every decode on its worker: ``stalled_s``.)
Chunking spreads the same compute over more steps, so it keeps the harm and bounds the per-token gap instead:
with a TPOT target, an option whose prefill makes its worker's running decodes' step (decode step + the per-step
stall) miss the target is dropped. An option's cost is TTFT + harm (the delay it adds for the new request and
for everyone it slows). The lowest cost chooses the worker that prefills; colocated/chunked on w and split with
P=w cost the same, and the kind preferred for that prompt on w breaks the tie. Split options are built for the
``SPLIT_CANDIDATES`` cheapest prefill workers only (the decision stays linear in workers).

A prefill is **long** on w -- split preferred, the new decode leaves w -- by what it does to w's decodes
(:func:`long_next_to`), when both hold:

1. The stall stretches their token gap past the target: with a TPOT target T, decode step + per-step stall
   (the whole prefill, or one chunk when chunked) > T; with none, per-step stall > ``local_stall_s``.
2. The harm (above: prefill x inflation-weighted decodes) is over ``split_harm_handoffs`` (default 1) times the
   hand-off the new request would pay instead: ``handoff_s`` + the KV transfer of its prompt.

The decodes are w's (n > 0, counting those awaiting their KV); on an idle worker, one never-stalled decode: the
one a colocated placement would leave there, which the next prefill like this one would stall. So a prompt
whose prefill costs a decode more than a hand-off splits even from an idle worker, keeping that worker free for
the next long prefill (Splitwise's mixed pool), and a prompt whose stall stays under the gap bound (a short
prompt on a GPU, a chunked prefill) runs colocated. With ``local_prefill_tokens`` set, long is simply "over that
many uncached tokens" everywhere (the operator's override). On one CPU core a 100-token prefill (~0.1 s) is
over the 50 ms stall bound and about one hand-off (~60-130 ms), so such prompts split when the decodes next to
them would pay more than a hand-off; ``split_harm_handoffs`` 2 keeps them colocated next to one decode and
spreads the decodes, but measured a worse TPOT tail there (docs/bench.md, "Retuning"): on two workers, decodes
spread onto both meet every 1.5K-token prefill, while decodes gathered on the worker that does not take the long
prefills meet none of them.

A worker with a prefill queued or running that is long next to its other decodes plus one new decode
(:func:`prefilling_long`) gets **no new decode** (neither colocated nor as D) while another worker can take it.

Options that miss the TTFT/TPOT target (or, with a TPOT target, find no KV room) are dropped; with none left the
request is rejected (429 + Retry-After), exactly as the fixed-role conductor does.

When a prefill is placed on a worker with running decodes, :mod:`.moves` may move those decodes to other workers
first (when the stall they would suffer is over a move's cost): the router stops each one's stream there, the
worker prefills its context from its prefix cache and hands the KV to the new worker as a P -> D hand-off.

The baselines (``round_robin``, ``least_loaded``) place whole requests, as on colocated workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .decision import Decision, PlacementRequest, PrefillOption
from .load import WorkerLoad
from .view import FleetView

SPLIT_CANDIDATES = 4  # split options are built for this many prefill workers, the cheapest ones


@dataclass(frozen=True)
class Prefill:
    """How a prefill would run on one worker (``option``'s), among the decodes already running there."""

    option: PrefillOption
    ttft_s: float  # queue + fetch + prefill + the decode part of every step it shares
    harm_s: float  # prefill seconds x running decodes there
    steps: int  # steps it spans (1 unless chunked into a decoding worker)
    stall_s: float  # what it adds to each of those steps for the running decodes (0 when there are none)
    step_s: float  # the running decodes' step time while it runs (their TPOT then; 0 when there are none)

    @property
    def total_stall_s(self) -> float:
        """What it adds to each running decode's time over all its steps."""
        return self.steps * self.stall_s

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


def step_budget(c: FleetView, running: int) -> int | None:
    """Prefill tokens one step of a worker running ``running`` decodes can take; None when unknown."""
    chunk = c.config.chunk_tokens
    return None if chunk is None else max(1, chunk - running)


def _shape(c: FleetView, new: int, cached: int, running: int, context: int) -> tuple[int, float, float, float]:
    """(steps, stall per step, the decodes' own step, whole prefill seconds) of a prefill of ``new`` tokens
    over ``cached`` ones on a worker running ``running`` decodes over ``context`` tokens in all."""
    cost = c.cost
    whole = cost.prefill_s(new, cached)
    if not running:
        return 1, 0.0, 0.0, whole
    decode_s = cost.decode_step_s(running, context)
    budget = step_budget(c, running)
    if budget is None or new <= budget:
        return 1, whole, decode_s, whole
    # vLLM fills each step with `budget` prompt tokens; the last chunk attends to the most context
    return math.ceil(new / budget), cost.prefill_s(budget, cached + new - budget), decode_s, whole


def prefill_on(c: FleetView, o: PrefillOption) -> Prefill:
    """o's prefill on its worker: one step, or chunked into the worker's decode steps."""
    w = o.worker
    n = w.running_decodes()
    if not n:
        return Prefill(o, o.ttft_s, 0.0, 1, 0.0, 0.0)
    steps, stall, decode_s, whole = _shape(c, o.new, o.cached, n, sum(j.context_tokens for j in w.decodes.values()))
    return Prefill(o, o.ttft_s + steps * decode_s, whole * inflation(w, decode_s), steps, stall, decode_s + stall)


def inflation(w: WorkerLoad, step_s: float) -> float:
    """Sum over w's decodes of 1 + (stalls already placed next to it) / (its output's plain decode time): a
    decode whose TPOT earlier prefills already stretched weighs more (each counts 1 when never stalled)."""
    return sum(1.0 + j.stalled_s / (j.gaps * step_s) if step_s > 0 else 1.0 for j in w.decodes.values())


def handoff_cost_s(c: FleetView, new_tokens: int, cached_tokens: int) -> float:
    """What a split adds to the new request: the fixed hand-off plus the KV transfer of its prompt."""
    cost = c.cost
    return cost.handoff_s + cost.transfer_s((new_tokens + cached_tokens) * cost.kv_bytes_per_token)


def gap_over(c: FleetView, stall_s: float, step_s: float) -> bool:
    """The stall stretches the decodes' token gap past the TPOT target (``step_s``: their step with it), or,
    with no target, it is over ``local_stall_s``."""
    slo = c.config.tpot_slo_s
    return step_s > slo if slo is not None else stall_s > c.config.local_stall_s


def long_next_to(c: FleetView, new_tokens: int, cached_tokens: int, running: int, stall_s: float, step_s: float,
                 harm_s: float) -> bool:
    """The rule (module docstring): with ``local_prefill_tokens`` set, over that many uncached tokens; else the
    prefill has ``running`` > 0 decodes next to it, stretches their gap past the target (:func:`gap_over`), and
    its harm to them is over the hand-off the new request would pay instead."""
    thr = c.config.local_prefill_tokens
    if thr is not None:
        return new_tokens > thr
    return running > 0 and gap_over(c, stall_s, step_s) and \
        harm_s > c.config.split_harm_handoffs * handoff_cost_s(c, new_tokens, cached_tokens)


def long_on(c: FleetView, s: Prefill) -> bool:
    """s's prefill is long on its worker: next to the decodes running there now, or, on an idle worker, next to
    one never-stalled decode (the one a colocated placement would leave there)."""
    o = s.option
    if o.worker.running_decodes():
        return long_next_to(c, o.new, o.cached, o.worker.running_decodes(), s.stall_s, s.step_s, s.harm_s)
    return is_long(c, o.new, o.cached, 1, o.new + o.cached)


def is_long(c: FleetView, new_tokens: int, cached_tokens: int, running: int = 1, context: int = 0) -> bool:
    """Long next to ``running`` never-stalled decodes over ``context`` tokens (default: one decode, as a new
    one would be)."""
    steps, stall, decode_s, whole = _shape(c, new_tokens, cached_tokens, running, context)
    return long_next_to(c, new_tokens, cached_tokens, running, stall, decode_s + stall, whole * running)


def prefilling_long(c: FleetView, w: WorkerLoad) -> bool:
    """w has a prefill queued or running that is long next to w's other decodes plus one new decode: w takes
    no new decode while another worker can."""
    for rid, j in w.prefills.items():
        others = [d for r, d in w.decodes.items() if r != rid]
        if is_long(c, j.new_tokens, j.cached_tokens, len(others) + 1, sum(d.context_tokens for d in others)):
            return True
    return False


def place(c: FleetView, req: PlacementRequest, ws: list[WorkerLoad]) -> Decision:
    """The conductor's elastic decision among ``ws`` (live, below the in-flight limit, at least one)."""
    now = c.clock()
    prefix = c.index.prefix_lengths(req.block_keys)
    shapes = {o.worker.worker_id: prefill_on(c, o) for o in c.prefill_options(req, ws, prefix, now)}
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
        return _charge(min(ok, key=_order))
    top = min(cands, key=_order)
    rej = c.reject_reason(top.decision, decoders, fits=top.fits) or _reject_stall(c, top, now)
    return rej if rej is not None else _charge(top)


def _charge(x: _Candidate) -> Decision:
    """The chosen prefill will stall the decodes running on its worker: note it on each (:func:`inflation`)."""
    s = x.prefill
    for j in s.option.worker.decodes.values():
        j.stalled_s += s.total_stall_s
    return x.decision


def _order(x: _Candidate) -> tuple[bool, float, int, tuple[str, ...]]:
    """KV room first (vLLM would queue the rest), then the lowest cost, the preferred kind, the worker ids."""
    return (not x.fits, x.cost, x.rank, x.ids)


def _colocated(c: FleetView, req: PlacementRequest, s: Prefill, now: float) -> _Candidate:
    o, w = s.option, s.option.worker
    long = long_on(c, s)
    kind = "chunked" if s.chunked else "colocated"
    n = w.running_decodes()
    if s.chunked:
        how = (f"in {s.steps} steps of <= {step_budget(c, n)} tokens, slows {n} running decode(s) by "
               f"{s.stall_s * 1e3:.0f} ms per step ({s.step_s * 1e3:.0f} ms per token)")
    else:
        how = f"stalls {n} running decode(s) by {s.stall_s * 1e3:.0f} ms"
    d = Decision("local", req.request_id, None, w.worker_id, ttft_s=s.ttft_s,
                 tpot_s=c.tpot_s(w, now, now + s.ttft_s, req), cached_tokens=o.cached, fetch_tokens=o.fetched,
                 fetch_tier=o.source,
                 reason=f"elastic {kind} on {w.worker_id}: {o.new} uncached prompt tokens "
                        f"({'long' if long else 'short'}), {how}", placement=kind)
    return _Candidate(1 if long else 0, s.cost_s, (w.worker_id,), d, c.fits(w, req, now), s)


def _split(c: FleetView, req: PlacementRequest, s: Prefill, decode: list[WorkerLoad], now: float
           ) -> _Candidate | None:
    if not decode:
        return None
    o, p = s.option, s.option.worker
    long = long_on(c, s)
    at = now + s.ttft_s
    fitting = [d for d in decode if c.fits(d, req, now)]
    tpots = {d.worker_id: c.tpot_s(d, now, at, req) for d in (fitting or decode)}
    d_id = min(tpots, key=lambda wid: (tpots[wid], wid))
    chunks = f" in {s.steps} chunked steps" if s.chunked else ""
    dec = Decision("disaggregated", req.request_id, p.worker_id, d_id, ttft_s=s.ttft_s, tpot_s=tpots[d_id],
                   cached_tokens=o.cached, fetch_tokens=o.fetched, fetch_tier=o.source,
                   reason=f"elastic split: prefill {o.new} uncached tokens ({'long' if long else 'short'}) on "
                          f"{p.worker_id}{chunks} ({p.running_decodes()} running decode(s)), decode on {d_id}"
                          + ("" if fitting else "; no decode worker has KV room"), placement="split")
    return _Candidate(0 if long else 1, s.cost_s, (p.worker_id, d_id), dec, bool(fitting), s)


def _meets(c: FleetView, x: _Candidate) -> bool:
    cfg = c.config
    d = x.decision
    if cfg.ttft_slo_s is not None and d.ttft_s > cfg.ttft_slo_s:
        return False
    if cfg.tpot_slo_s is not None and (d.tpot_s > cfg.tpot_slo_s or not x.fits or x.prefill.step_s > cfg.tpot_slo_s):
        return False
    return True


def _reject_stall(c: FleetView, x: _Candidate, now: float) -> Decision | None:
    """The best option meets the targets for the new request but slows the prefilling worker's running decodes
    past the TPOT target: reject, retry when the first of them is predicted to finish."""
    slo = c.config.tpot_slo_s
    s = x.prefill
    if slo is None or s.step_s <= slo:
        return None
    w = s.option.worker
    d = x.decision
    return Decision("reject", d.request_id, d.prefill, d.decode, ttft_s=d.ttft_s, tpot_s=d.tpot_s,
                    retry_after_s=float(max(1, math.ceil(c.drain_s(w, now)))),
                    reason=f"prefilling on {w.worker_id} would slow its {w.running_decodes()} running decode(s) to "
                           f"{s.step_s * 1e3:.1f} ms per token > TPOT target {slo * 1e3:.1f} ms", code="slo")
