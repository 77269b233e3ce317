"""Elastic roles: every worker may prefill, decode, or both, chosen per request (issue 16, item 1).

Workers of role ``elastic`` run pdserve's connector as ``kv_both`` and have no fixed role. For each request the
conductor (policy ``conductor``) weighs two kinds of option over the live workers below their in-flight limit:

- **colocated** on w (kind ``local``): prefill and decode on w. TTFT = queue(w) + fetch + prefill (+ one decode
  step when w is decoding, as for decode-local).
- **split** P=p, D=d (kind ``disaggregated``, p != d): the existing P -> D hand-off. TTFT = the same on p; D is
  the worker with the lowest TPOT predicted at the moment p's prefill ends, among those with KV room.

Every option also carries its **harm**: the prefill stalls each decode already running on the worker that
computes it, so harm = predicted prefill seconds x running decodes there. An option's cost is TTFT + harm (the
delay it adds for the new request and for everyone it stalls). The lowest cost chooses the worker that
prefills; colocated on w and split with P=w cost the same, and the prompt's length breaks that tie. Split options
are built for the ``SPLIT_CANDIDATES`` cheapest prefill workers only (the decision stays linear in workers).

A prompt is **long** when its uncached part is over ``local_prefill_tokens`` (when set) or its predicted
prefill is over both ``local_stall_s`` and the hand-off (fixed cost + KV transfer) a split would add. Long
prompts prefer split: the decode goes to another worker, so the prefilling worker stays free of decodes and the
next long prefill there stalls nobody (Splitwise's mixed pool). Short prompts prefer colocated: no hand-off,
and the stall is small. A worker with a long prefill queued or
running gets **no new decode** (neither colocated nor as D) while another worker can take it.

Options that miss the TTFT/TPOT target (or, with a TPOT target, find no KV room) are dropped; with none left the
request is rejected (429 + Retry-After), exactly as the fixed-role conductor does.

The baselines (``round_robin``, ``least_loaded``) place whole requests, as on colocated workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .load import WorkerLoad

if TYPE_CHECKING:
    from .policy import Conductor, Decision, PlacementRequest, _Option


SPLIT_CANDIDATES = 4  # split options are built for this many prefill workers, the cheapest ones


@dataclass(frozen=True)
class _Candidate:
    rank: int  # 0: the preferred kind for this prompt (split when long, colocated when short)
    cost: float  # ttft + harm
    ids: tuple[str, ...]  # (prefill worker, decode worker) or (worker,): the tie-break
    decision: Decision
    fits: bool


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


def prefilling_long(c: Conductor, w: WorkerLoad) -> bool:
    """w has a long prefill queued or running: it takes no new decode while another worker can."""
    return any(is_long(c, j.new_tokens, j.cached_tokens) for j in w.prefills.values())


def place(c: Conductor, req: PlacementRequest, ws: list[WorkerLoad]) -> Decision:
    """The conductor's elastic decision among ``ws`` (live, below the in-flight limit, at least one)."""
    now = c.clock()
    prefix = c.index.prefix_lengths(req.block_keys)
    options = {o.worker.worker_id: o for o in c._prefill_options(req, ws, prefix, now)}
    best = min(options.values(), key=lambda o: (o.ttft_s, o.worker.worker_id))
    long = is_long(c, best.new, best.cached)
    decoders = [w for w in ws if not prefilling_long(c, w)] or ws
    cands = [_colocated(c, req, options[w.worker_id], now, rank=1 if long else 0) for w in decoders]
    # a split with P=p costs what colocated on p costs: only the cheapest few P can win (linear, not quadratic)
    cheapest = sorted(ws, key=lambda w: (_prefill_cost(c, options[w.worker_id]), w.worker_id))[:SPLIT_CANDIDATES]
    for p in cheapest:
        split = _split(c, req, options[p.worker_id], [d for d in decoders if d is not p], now,
                       rank=0 if long else 1)
        if split is not None:
            cands.append(split)
    ok = [x for x in cands if _meets(c, x)]
    if ok:
        return min(ok, key=_order).decision
    top = min(cands, key=_order)
    rej = c._reject_reason(top.decision, decoders, fits=top.fits)
    return rej if rej is not None else top.decision


def _prefill_cost(c: Conductor, o: _Option) -> float:
    """TTFT + harm of prefilling on o's worker, the cost every option with that prefill worker has."""
    return o.ttft_s + _extra_s(c, o.worker) + _stall_s(c, o) * o.worker.running_decodes()


def _order(x: _Candidate) -> tuple[bool, float, int, tuple[str, ...]]:
    """KV room first (vLLM would queue the rest), then the lowest cost, the preferred kind, the worker ids."""
    return (not x.fits, x.cost, x.rank, x.ids)


def _stall_s(c: Conductor, o: _Option) -> float:
    """Seconds o's prefill holds up the decodes running on its worker (0 when there are none)."""
    return c.cost.prefill_s(o.new, o.cached) if o.worker.running_decodes() else 0.0


def _extra_s(c: Conductor, w: WorkerLoad) -> float:
    """A prefill on a decoding worker shares steps with its decodes: about one decode step more."""
    n = w.running_decodes()
    return c.cost.decode_step_s(n, 1) if n else 0.0


def _colocated(c: Conductor, req: PlacementRequest, o: _Option, now: float, rank: int) -> _Candidate:
    from .policy import Decision

    w = o.worker
    ttft = o.ttft_s + _extra_s(c, w)
    d = Decision("local", req.request_id, None, w.worker_id, ttft_s=ttft, tpot_s=c._tpot(w, now, now + ttft, req),
                 cached_tokens=o.cached, fetch_tokens=o.fetched,
                 reason=f"elastic colocated on {w.worker_id}: {o.new} uncached prompt tokens "
                        f"({'long' if rank else 'short'}), stalls {w.running_decodes()} running decode(s) "
                        f"by {_stall_s(c, o) * 1e3:.0f} ms")
    return _Candidate(rank, _prefill_cost(c, o), (w.worker_id,), d, c._fits(w, req, now))


def _split(c: Conductor, req: PlacementRequest, o: _Option, decode: list[WorkerLoad], now: float, rank: int
           ) -> _Candidate | None:
    from .policy import Decision

    if not decode:
        return None
    p = o.worker
    ttft = o.ttft_s + _extra_s(c, p)
    at = now + ttft
    fitting = [d for d in decode if c._fits(d, req, now)]
    tpots = {d.worker_id: c._tpot(d, now, at, req) for d in (fitting or decode)}
    d_id = min(tpots, key=lambda wid: (tpots[wid], wid))
    dec = Decision("disaggregated", req.request_id, p.worker_id, d_id, ttft_s=ttft, tpot_s=tpots[d_id],
                   cached_tokens=o.cached, fetch_tokens=o.fetched,
                   reason=f"elastic split: prefill {o.new} uncached tokens ({'short' if rank else 'long'}) on "
                          f"{p.worker_id} ({p.running_decodes()} running decode(s)), decode on {d_id}"
                          + ("" if fitting else "; no decode worker has KV room"))
    return _Candidate(rank, _prefill_cost(c, o), (p.worker_id, d_id), dec, bool(fitting))


def _meets(c: Conductor, x: _Candidate) -> bool:
    cfg = c.config
    d = x.decision
    if cfg.ttft_slo_s is not None and d.ttft_s > cfg.ttft_slo_s:
        return False
    if cfg.tpot_slo_s is not None and (d.tpot_s > cfg.tpot_slo_s or not x.fits):
        return False
    return True
