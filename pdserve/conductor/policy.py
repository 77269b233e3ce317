"""The placement decision, and the request lifecycle that keeps the load view and the cost model current.

Per request (policy ``conductor``):

1. Prefix: the index gives, per holder, how many leading blocks of the prompt it holds.
2. For each prefill worker p: cached = p's own prefix, or the pool's when loading the extra blocks is
   predicted faster than computing them; TTFT(p) = queue(p) + fetch + prefill(new, cached). Best p = min.
3. Decode worker: among those whose free KV fits prompt + max_tokens, the lowest TPOT predicted at the moment
   the prefill would finish (its decode batch then, plus this request).
4. Decode-local: run everything on that D when the uncached prompt is short (``local_prefill_tokens``, or
   learned: local reaches the second token sooner than prefill + hand-off + transfer and the prefill stalls
   D's running decodes by at most ``local_stall_s``), or when every P misses the TTFT target and local meets it.
5. Reject (Retry-After) when the best predicted TTFT or TPOT misses its target.

``round_robin`` and ``least_loaded`` are the baselines: same interface, never local, never reject.
Colocated workers (role ``colocated``) only ever get whole requests ("local"). Elastic workers (role
``elastic``, no fixed role) get, per request, a whole request or a prefill or a decode: see :mod:`.elastic`.

The predictions (TTFT, TPOT, KV room, drain time, targets) live in :class:`~.view.FleetView`, which the
:class:`Conductor` is: the elastic rule and the moves use them through that view and never import this module's
privates. The conductor is the one owner of placements: what it placed is recorded (:meth:`Conductor.record`),
read (:meth:`Conductor.decision_of`, :meth:`Conductor.prefill_worker_of`) and released (:meth:`Conductor.finished`)
through public methods only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from . import elastic
from .config import ConductorConfig
from .cost_model import CostModel
from .decision import Candidate, Decision, NoWorker, Placed, PlacementRequest, PrefillOption
from .load import ROLES, DecodeJob, PrefillJob, Reported, WorkerLoad
from .shortlist import SHORTLIST, LoadOrder, decode_key, prefill_key
from .view import STORE_SUFFIX, FleetView


class Conductor(FleetView):
    """The placement policy over a :class:`~.view.FleetView`: decides (:meth:`place`), records what it placed and
    keeps the load view and the cost model current from each request's lifecycle."""

    def __init__(self, config: ConductorConfig, cost: CostModel, clock: Callable[[], float] = time.monotonic,
                 shortlist: int = SHORTLIST) -> None:
        super().__init__(config, cost, clock)
        if shortlist < 1:
            raise ValueError(f"shortlist={shortlist!r}: at least 1 candidate per role")
        self.shortlist = shortlist  # least-loaded candidates per role in a fixed-role placement (:mod:`.shortlist`)
        self._prefill_order = LoadOrder(prefill_key)  # healthy workers that can prefill, least loaded first
        self._decode_order = LoadOrder(decode_key)  # healthy workers that can decode
        self._whole_ids: set[str] = set()  # healthy colocated and elastic workers (they take the full path)
        self._placed: dict[str, Placed] = {}
        self._rr = {"prefill": 0, "decode": 0, "colocated": 0, "survivor": 0}
        self.counts = {"disaggregated": 0, "local": 0, "reject": 0}
        self.placements = {"colocated": 0, "chunked": 0, "split": 0}  # elastic decisions by placement kind
        self.last_prefill: PrefillJob | None = None

    # ---- membership ----
    def add_worker(self, worker_id: str, role: str, kv_capacity_tokens: int) -> None:
        if role not in ROLES:
            raise ValueError(f"role={role!r}: one of {', '.join(ROLES)}")
        old = self.workers.get(worker_id)
        if old is not None and old.role == role:
            old.kv_capacity_tokens = kv_capacity_tokens or old.kv_capacity_tokens
            old.healthy = True
        else:
            self.workers[worker_id] = WorkerLoad(worker_id, role, kv_capacity_tokens)
        self._rekey(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Stop placing on it and forget its cache; requests already there finish (their ``finished`` call
        still works)."""
        self.workers.pop(worker_id, None)
        self.forget_cache(worker_id)
        self._rekey(worker_id)

    def set_health(self, worker_id: str, healthy: bool) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            if w.healthy and not healthy:
                self.forget_cache(worker_id)  # a restarted worker comes back with an empty cache
            w.healthy = healthy
            self._rekey(worker_id)

    def _rekey(self, *worker_ids: str | None) -> None:
        """Put each worker where its role, health and load now place it in the load orders (:mod:`.shortlist`):
        called by every method here that changes a worker's queued prefills, decodes, role or health."""
        for wid in worker_ids:
            if wid is None:
                continue
            w = self.workers.get(wid)
            live = w is not None and w.healthy
            for order, member in ((self._prefill_order, live and w is not None and w.can_prefill),
                                  (self._decode_order, live and w is not None and w.can_decode)):
                if member and w is not None:
                    order.update(w)
                else:
                    order.discard(wid)
            if live and w is not None and w.role in ("colocated", "elastic"):
                self._whole_ids.add(wid)
            else:
                self._whole_ids.discard(wid)

    def report_load(self, worker_id: str, waiting: int, running: int, kv_usage: float,
                    kv_capacity_tokens: int | None = None) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.reported = Reported(self.clock(), waiting, running, kv_usage)
            if kv_capacity_tokens:
                w.kv_capacity_tokens = kv_capacity_tokens
            if self.config.replicas > 1:  # beyond this replica's own: the other replicas' (load.Others)
                w.merge_report(w.reported.at, waiting, running, self.last_prefill)
                self._rekey(worker_id)

    def expire_reports(self) -> None:
        """Drop the other replicas' load where its report went stale (call once per load round)."""
        if self.config.replicas <= 1:
            return
        now = self.clock()
        for w in list(self.workers.values()):
            if w.expire_others(now, self.config.load_staleness_s):
                self._rekey(w.worker_id)

    # ---- index events ----
    def blocks_stored(self, holder: str, keys: Iterable[int]) -> None:
        self.index.stored(holder, keys)
        if holder.endswith(STORE_SUFFIX):
            self.store_holders.add(holder)

    def blocks_removed(self, holder: str, keys: Iterable[int]) -> None:
        self.index.removed(holder, keys)

    def all_cleared(self, holder: str) -> None:
        self.index.cleared(holder)
        self.store_holders.discard(holder)

    # ---- the decision ----
    def place(self, req: PlacementRequest, exclude: frozenset[str] = frozenset()) -> Decision:
        """Choose where ``req`` runs and reserve it in the load view (call :meth:`finished` when it ends,
        whatever happens). Raises :class:`NoWorker` when no live worker is left at all.

        With one role gone the survivors serve whole requests (kind "local", reason "degraded: ..."): a prefill
        worker decodes what it prefilled, a decode worker prefills locally. Workers at
        ``max_inflight_per_worker`` are skipped; when every candidate of a needed role is, the request is
        rejected (kind "reject", Retry-After).

        Policy ``conductor`` over fixed roles weighs only the prefix holders and the least-loaded few of each role
        (:meth:`_bounded`), so one placement does not grow with the fleet."""
        d = self._whole_only(req, exclude) if req.whole else self._bounded(req, exclude)
        if d is None:
            d = self._place_all(req, exclude)
        if self.recal.window > 0:  # the corrections the predictions carry (the record shows both figures)
            d = replace(d, ttft_factor=self.recal.factor("ttft"), tpot_factor=self.recal.factor("tpot"),
                        settled=self.prefills_seen >= self.recal.warmup)
        self.counts[d.kind] += 1
        if d.placement:
            self.placements[d.placement] += 1
        if d.kind != "reject":
            self._reserve(req, d)
        return d

    def place_on(self, req: PlacementRequest, prefill: str | None, decode: str, reason: str) -> Decision:
        """Place ``req`` on workers named from outside (a gateway's endpoint picker): P ``prefill`` -> D ``decode``,
        or the whole request on ``decode`` when ``prefill`` is None. The pair is not weighed (no reject, no
        decode-local switch); the decision carries the predictions for it and is reserved as :meth:`place`'s are
        (call :meth:`finished`). Raises :class:`NoWorker` when a named worker is unknown."""
        for wid, role in ((prefill, "prefill"), (decode, "decode")):
            if wid is not None and wid not in self.workers:
                raise NoWorker(role, f"{role} worker {wid} is not registered")
        now = self.clock()
        d = self.workers[decode]
        prefix = self.index.prefix_lengths(req.block_keys)
        if prefill is None:
            ttft, cached = self.local_ttft(req, d, now, prefix)
            out = Decision("local", req.request_id, None, decode, ttft_s=ttft,
                           tpot_s=self.tpot_s(d, now, now + ttft, req), cached_tokens=cached, reason=reason)
        else:
            o = self.prefill_options(req, [self.workers[prefill]], prefix, now)[0]
            out = Decision("disaggregated", req.request_id, prefill, decode, ttft_s=o.ttft_s,
                           tpot_s=self.tpot_s(d, now, now + o.ttft_s, req), cached_tokens=o.cached,
                           fetch_tokens=o.fetched, fetch_tier=o.source, reason=reason)
        self.counts[out.kind] += 1
        self._reserve(req, out)
        return out

    def _bounded(self, req: PlacementRequest, exclude: frozenset[str]) -> Decision | None:
        """The conductor's fixed-role decision among the prefill workers that hold a prefix of the prompt plus the
        ``shortlist`` least-loaded ones, and the ``shortlist`` least-loaded decode workers (more when none of
        those has KV room), all live and below their in-flight limit. None when another path decides: a baseline
        policy, live colocated or elastic workers, or no such prefill or decode worker (a role missing, every
        worker at its limit)."""
        if self.config.policy != "conductor" or any(wid not in exclude for wid in self._whole_ids):
            return None
        limit = self.config.max_inflight_per_worker
        ok: Callable[[WorkerLoad], bool] = lambda w: w.worker_id not in exclude and (  # noqa: E731
            limit is None or w.in_flight() < limit)
        now = self.clock()
        decode = self._decode_order.least(self.shortlist, ok)
        if decode and not any(self.fits(w, req, now) for w in decode) and len(self._decode_order) > len(decode):
            decode += self._decode_order.least(self.shortlist, lambda w: ok(w) and self.fits(w, req, now))
        prefill = self._prefill_order.least(self.shortlist, ok)
        if not decode or not prefill:
            return None
        prefix = self.index.prefix_lengths(req.block_keys)
        seen = {w.worker_id for w in prefill}
        for h in prefix:
            if h not in seen and h in self._prefill_order and ok(self.workers[h]):
                prefill.append(self.workers[h])
        return self._conduct(req, prefill, decode, prefix)

    def _place_all(self, req: PlacementRequest, exclude: frozenset[str]) -> Decision:
        """Every live worker weighed: the baselines, colocated and elastic pools, and what :meth:`_bounded`
        leaves (a missing role, every candidate at its limit)."""
        live = [w for w in self.workers.values() if w.healthy and w.worker_id not in exclude]
        colocated = [w for w in live if w.role == "colocated"]
        elastic = [w for w in live if w.role == "elastic"]
        if elastic:
            free = self._free(elastic)
            d = self._elastic(req, free) if free else self._busy(req, elastic)
        elif colocated:
            free = self._free(colocated)
            d = self._colocated(req, free) if free else self._busy(req, colocated)
        else:
            prefill = [w for w in live if w.can_prefill]
            decode = [w for w in live if w.can_decode]
            if not prefill and not decode:
                raise NoWorker("any", "no live worker")
            if not prefill or not decode:
                survivors, missing = (prefill, "decode") if prefill else (decode, "prefill")
                free = self._free(survivors)
                d = self._survivor(req, free, missing) if free else self._busy(req, survivors)
            else:
                fp, fd = self._free(prefill), self._free(decode)
                if not fp or not fd:
                    d = self._busy(req, prefill if not fp else decode)
                elif self.config.policy != "conductor":
                    d = self._baseline(req, fp, fd)
                else:
                    d = self._conduct(req, fp, fd)
        return d

    def _whole_only(self, req: PlacementRequest, exclude: frozenset[str]) -> Decision:
        """A request that must run whole on one worker (``req.whole``): on a worker that decodes (decode, colocated
        or elastic) picked as a whole request is (:meth:`_whole`); with none live, on a prefill worker (a survivor)."""
        live = [w for w in self.workers.values() if w.healthy and w.worker_id not in exclude]
        if not live:
            raise NoWorker("any", "no live worker")
        decoders = [w for w in live if w.can_decode or w.role == "colocated"]
        ws = decoders or live
        free = self._free(ws)
        if not free:
            return self._busy(req, ws)
        return self._whole(req, free, "decode", lambda w: f"whole request on {w.role} worker {w.worker_id} "
                                                          "(it runs on one worker)")

    # -- limits and survivors --
    def _free(self, ws: list[WorkerLoad]) -> list[WorkerLoad]:
        """The workers below their in-flight limit."""
        limit = self.config.max_inflight_per_worker
        return ws if limit is None else [w for w in ws if w.in_flight() < limit]

    def _busy(self, req: PlacementRequest, full: list[WorkerLoad]) -> Decision:
        """Every candidate is at its in-flight limit: reject, retry when the first of them frees a slot."""
        now = self.clock()
        wait = min((self.drain_s(w, now) for w in full), default=1.0)
        role = full[0].role if full else "worker"
        return Decision("reject", req.request_id, retry_after_s=float(max(1, math.ceil(wait))),
                        reason=f"every live {role} worker has {self.config.max_inflight_per_worker} requests in "
                               "flight (max_inflight_per_worker)", code="worker_limit")

    def _survivor(self, req: PlacementRequest, ws: list[WorkerLoad], missing: str) -> Decision:
        """No live ``missing`` worker: the whole request on one of the others (P decodes locally, D prefills)."""
        return self._whole(req, ws, "survivor", lambda w: f"degraded: no live {missing} worker, whole request on "
                                                          f"{w.role} worker {w.worker_id}")

    def _whole(self, req: PlacementRequest, ws: list[WorkerLoad], ring: str,
               reason: Callable[[WorkerLoad], str]) -> Decision:
        """The whole request (kind "local") on the worker of ``ws`` the policy picks: the next on round-robin
        ``ring``, the least loaded, or (conductor) the lowest predicted TTFT."""
        now = self.clock()
        prefix = self.index.prefix_lengths(req.block_keys)  # once: every candidate's TTFT reads it
        policy = self.config.policy
        if policy == "round_robin":
            w = self._pick_rr(ring, ws)
        elif policy == "least_loaded":
            w = min(ws, key=lambda w: (w.queued_prefill_tokens() + w.running_decodes(), w.worker_id))
        else:
            w = min(ws, key=lambda w: (self.local_ttft(req, w, now, prefix)[0], w.worker_id))
        ttft, cached = self.local_ttft(req, w, now, prefix)
        return Decision("local", req.request_id, None, w.worker_id, ttft_s=ttft,
                        tpot_s=self.tpot_s(w, now, now + ttft, req), cached_tokens=cached, reason=reason(w))

    # -- baselines --
    def _pick_rr(self, ring: str, ws: list[WorkerLoad]) -> WorkerLoad:
        w = ws[self._rr[ring] % len(ws)]  # in membership order
        self._rr[ring] += 1
        return w

    def _baseline(self, req: PlacementRequest, prefill: list[WorkerLoad], decode: list[WorkerLoad]) -> Decision:
        now = self.clock()
        if self.config.policy == "round_robin":
            p = self._pick_rr("prefill", prefill)
        else:
            p = min(prefill, key=lambda w: (w.queued_prefill_tokens(), len(w.prefills), w.worker_id))
        d = self._baseline_decode(decode, now)
        cached = self.own_cached(req, p)
        return Decision("disaggregated", req.request_id, p.worker_id, d.worker_id,
                        ttft_s=(p.queue_s(now) + self.cost.prefill_s(req.prompt_tokens - cached, cached))
                        * self.recal.factor("ttft"),
                        tpot_s=self.tpot_s(d, now, now, req), reason=self.config.policy, cached_tokens=cached)

    def _baseline_decode(self, decode: list[WorkerLoad], now: float) -> WorkerLoad:
        if self.config.policy == "round_robin":
            return self._pick_rr("decode", decode)
        st = self.config.load_staleness_s
        return min(decode, key=lambda w: (w.running_decodes(), w.kv_used_tokens(now, st), w.worker_id))

    def _colocated(self, req: PlacementRequest, ws: list[WorkerLoad]) -> Decision:
        policy = self.config.policy
        d = self._whole(req, ws, "colocated", lambda w: f"colocated ({policy})")
        if policy == "conductor":
            rej = self.reject_reason(d, [self.workers[d.decode or ""]])
            if rej is not None:
                return rej
        return d

    def _elastic(self, req: PlacementRequest, ws: list[WorkerLoad]) -> Decision:
        """Workers without a fixed role: colocated or split per request (:mod:`.elastic`); the baselines place
        whole requests."""
        if self.config.policy != "conductor":
            return self._colocated(req, ws)
        return elastic.place(self, req, ws)

    # -- the conductor --
    def _conduct(self, req: PlacementRequest, prefill: list[WorkerLoad], decode: list[WorkerLoad],
                 prefix: dict[str, int] | None = None) -> Decision:
        now = self.clock()
        if prefix is None:
            prefix = self.index.prefix_lengths(req.block_keys)
        options = self.prefill_options(req, prefill, prefix, now)
        best = min(options, key=lambda o: (o.ttft_s, o.worker.queued_prefill_tokens(), o.worker.worker_id))
        at = now + best.ttft_s
        fitting = [d for d in decode if self.fits(d, req, now)]
        tpots = {w.worker_id: self.tpot_s(w, now, at, req) for w in (fitting or decode)}
        d = self.workers[min(tpots, key=lambda wid: (tpots[wid], wid))]
        tpot = tpots[d.worker_id]
        disagg = Decision("disaggregated", req.request_id, best.worker.worker_id, d.worker_id, ttft_s=best.ttft_s,
                          tpot_s=tpot, cached_tokens=best.cached, fetch_tokens=best.fetched, fetch_tier=best.source,
                          reason="lowest predicted TTFT" + ("" if fitting else "; no decode worker has KV room"))
        local = self._local_choice(req, d, now, best, tpot, prefix)
        chosen = local or disagg
        weighed = tuple(Candidate(o.worker.worker_id, "prefill", o.ttft_s, o.cached, o.fetched, o.source)
                        for o in options) + tuple(Candidate(w, "decode", t) for w, t in tpots.items())
        return replace(self.reject_reason(chosen, decode, fits=bool(fitting)) or chosen, candidates=weighed)

    def _local_choice(self, req: PlacementRequest, d: WorkerLoad, now: float, best: PrefillOption, tpot: float,
                      prefix: dict[str, int]) -> Decision | None:
        if not d.can_decode:
            return None
        l_ttft, l_cached = self.local_ttft(req, d, now, prefix)
        uncached = req.prompt_tokens - l_cached
        l_prefill = self.cost.prefill_s(uncached, l_cached)
        mk = lambda why: Decision("local", req.request_id, None, d.worker_id, ttft_s=l_ttft,  # noqa: E731
                                  tpot_s=self.tpot_s(d, now, now + l_ttft, req), cached_tokens=l_cached, reason=why)
        thr = self.config.local_prefill_tokens
        if thr is not None:
            return mk(f"uncached prompt {uncached} <= {thr} tokens") if uncached <= thr else None
        hand = self.cost.handoff_s + self.cost.transfer_s(req.prompt_tokens * self.cost.kv_bytes_per_token)
        second_local = l_ttft + tpot
        second_pd = best.ttft_s + hand
        stall_ok = d.running_decodes() == 0 or l_prefill <= self.config.local_stall_s
        if stall_ok and second_local <= second_pd:
            return mk(f"uncached prompt {uncached} tokens: local prefill {l_prefill * 1e3:.0f} ms beats "
                      f"P + hand-off {second_pd * 1e3:.0f} ms")
        slo = self.config.ttft_slo_s
        if slo is not None and best.ttft_s > slo and l_ttft <= slo:
            return mk(f"every prefill worker misses TTFT {slo * 1e3:.0f} ms (best {best.ttft_s * 1e3:.0f} ms); "
                      f"local {l_ttft * 1e3:.0f} ms")
        return None

    # ---- lifecycle ----
    def _reserve(self, req: PlacementRequest, d: Decision) -> None:
        now = self.clock()
        new = req.prompt_tokens - d.cached_tokens
        prefill = PrefillJob(req.request_id, new, d.cached_tokens, self.cost.prefill_s(new, d.cached_tokens), now)
        self.last_prefill = prefill  # what one of another replica's prefills costs where this one has none
        self.record(d, prefill, DecodeJob(req.request_id, req.prompt_tokens, req.max_tokens,
                                          req.prompt_tokens + req.max_tokens))

    def record(self, d: Decision, prefill: PrefillJob | None, decode: DecodeJob, first: bool = False) -> None:
        """Hold placement ``d`` in the load view: ``prefill`` queued on the worker that computes the prompt (the P
        of a split, else the whole request's worker), at the head of its queue when ``first`` (a move's tail runs
        before the prefills queued there), and ``decode`` on d's decode worker. A request holds one placement:
        release its old one first (:meth:`finished`)."""
        prefill_on = d.prefill if d.kind == "disaggregated" else d.decode
        assert prefill_on is not None and d.decode is not None
        pw, dw = self.workers[prefill_on], self.workers[d.decode]
        if prefill is not None:
            if first:
                pw.prefills = {d.request_id: prefill, **pw.prefills}
            else:
                pw.prefills[d.request_id] = prefill
        dw.decodes[d.request_id] = decode
        self._placed[d.request_id] = Placed(d, prefill_on, d.decode)
        self._rekey(prefill_on, d.decode)

    def decision_of(self, request_id: str) -> Decision | None:
        """The decision a request now runs on (a move's replaces its first); None when it is not placed."""
        pl = self._placed.get(request_id)
        return pl.decision if pl is not None else None

    def prefill_worker_of(self, request_id: str) -> str | None:
        """The worker that computes the request's prompt; None when it is not placed (or has none)."""
        pl = self._placed.get(request_id)
        return pl.prefill_worker if pl is not None else None

    def prefill_done(self, request_id: str, cached_tokens: int | None = None) -> None:
        """The prompt is computed (P answered, or a local request's first token arrived)."""
        pl = self._placed.get(request_id)
        if pl is None or pl.prefill_worker is None or pl.prefill_done_at is not None:
            return
        now = self.clock()
        pl.prefill_done_at = now
        w = self.workers.get(pl.prefill_worker)
        if w is not None:
            job = w.prefills.pop(request_id, None)
            if job is not None:
                began = max(job.enqueued_at, w.last_prefill_end)
                observe = getattr(self.cost, "observe_prefill", None)
                self.prefills_seen += 1
                if observe is not None and now > began:
                    new = job.new_tokens if cached_tokens is None \
                        else job.new_tokens + job.cached_tokens - cached_tokens
                    observe(new, job.cached_tokens if cached_tokens is None else cached_tokens, now - began)
                self._observe_load(pl.decision, job.new_tokens, job.cached_tokens, now - began)
            w.last_prefill_end = max(w.last_prefill_end, now)
            self._rekey(w.worker_id)
        dw = self.workers.get(pl.decode_worker or "")
        if dw is not None and request_id in dw.decodes:
            job_d = dw.decodes[request_id]
            job_d.started_at = now
            job_d.last_progress_at = now

    def _observe_load(self, d: Decision, new: int, cached: int, seconds: float) -> None:
        """A prefill that loaded KV from a tier: what it took beyond the predicted compute is that load's time."""
        if d.fetch_tokens > 0 and d.fetch_tier:
            load = seconds - self.cost.prefill_s(new, cached)
            self.tier_costs.observe(d.fetch_tier, d.fetch_tokens * self.cost.kv_bytes_per_token, load)

    def replace_decode(self, request_id: str, exclude: frozenset[str] = frozenset()) -> str:
        """Move a placed request's decode to another worker (its D failed before answering): the prefill side
        (P, its queue, its prefill observation) is untouched; the new D is chosen the way the policy picks a
        decode worker (round-robin ring, least loaded, or lowest predicted TPOT among those with KV room), never
        the request's prefill worker. Raises :class:`NoWorker` when no live decode worker is left, KeyError for an
        unknown request."""
        pl = self._placed[request_id]
        old = self.workers.get(pl.decode_worker or "")
        job = old.decodes.pop(request_id, None) if old is not None else None
        skip = exclude | {pl.decode_worker or ""}
        if pl.decision.kind == "disaggregated" and pl.prefill_worker:
            # never P itself: its KV is leased for the hand-off (a worker that can both prefill and decode, as in
            # an elastic pool, would otherwise be asked to load its own blocks); with no other D left the router
            # migrates the request (the whole of it on another worker)
            skip |= {pl.prefill_worker}
        decode = [w for w in self.workers.values() if w.healthy and w.can_decode and w.worker_id not in skip]
        if not decode:
            if job is not None and old is not None:
                old.decodes[request_id] = job  # nothing moved: finished() still releases it there
            raise NoWorker("decode", "no live decode worker")
        now = self.clock()
        ctx, left = (job.context_tokens, job.remaining_tokens) if job is not None else (0, 0)
        req = PlacementRequest(request_id, ctx, (), left)
        if self.config.policy != "conductor":
            d = self._baseline_decode(decode, now)
        else:
            fitting = [w for w in decode if self.fits(w, req, now)] or decode
            d = min(fitting, key=lambda w: (self.tpot_s(w, now, now, req), w.worker_id))
        if job is not None:
            job.last_progress_at = now if job.started_at is not None else None
            d.decodes[request_id] = job
        pl.decode_worker = d.worker_id
        self._rekey(old.worker_id if old is not None else None, d.worker_id)
        pl.first_decode_seen = True  # the wait on the failed D is no hand-off time: do not observe it
        return d.worker_id

    def decode_progress(self, request_id: str, tokens_done: int) -> None:
        """``tokens_done`` output tokens so far (including the first). Feeds decode-step and hand-off times."""
        pl = self._placed.get(request_id)
        if pl is None:
            return
        w = self.workers.get(pl.decode_worker or "")
        job = w.decodes.get(request_id) if w is not None else None
        if w is None or job is None or job.started_at is None or tokens_done <= job.tokens_done:
            return
        now = self.clock()
        delta = tokens_done - job.tokens_done
        if job.tokens_done >= 2 and job.last_progress_at is not None:
            observe = getattr(self.cost, "observe_decode_step", None)
            if observe is not None:
                batch = ctx = 0  # one pass: this runs on every progress report of every running decode
                for j in w.decodes.values():
                    if j.started_at is not None:
                        batch += 1
                        ctx += j.context_tokens
                observe(batch, ctx, (now - job.last_progress_at) / delta)
        elif job.tokens_done == 1 and pl.decision.kind == "disaggregated" and not pl.first_decode_seen:
            pl.first_decode_seen = True
            observe_h = getattr(self.cost, "observe_handoff", None)
            if observe_h is not None and pl.prefill_done_at is not None:
                observe_h(now - pl.prefill_done_at)
        job.tokens_done = tokens_done
        job.context_tokens += delta
        job.remaining_tokens = max(0, job.remaining_tokens - delta)
        job.last_progress_at = now

    def recalibrate(self, d: Decision, ttft_s: float | None, tpot_s: float | None) -> None:
        """A closed placement's measured TTFT and TPOT (None: not measured) against ``d``'s predictions: the
        workers' correction factors learn from the error (:mod:`.recalibration`)."""
        if not d.settled:  # decided while the cost model still left its start-up fit: that error it corrects itself
            return
        if ttft_s is not None:
            self.recal.observe("ttft", ttft_s, d.ttft_s / d.ttft_factor)
        if tpot_s is not None:
            self.recal.observe("tpot", tpot_s, d.tpot_s / d.tpot_factor)

    def finished(self, request_id: str) -> None:
        """The request ended (done, failed, aborted): release everything reserved for it."""
        pl = self._placed.pop(request_id, None)
        if pl is None:
            return
        for wid in (pl.prefill_worker, pl.decode_worker):
            w = self.workers.get(wid or "")
            if w is not None:
                w.prefills.pop(request_id, None)
                w.decodes.pop(request_id, None)
        self._rekey(pl.prefill_worker, pl.decode_worker)

    def in_flight(self) -> int:
        return len(self._placed)

    def snapshot(self) -> list[dict]:
        now = self.clock()
        st = self.config.load_staleness_s
        return [{"worker": w.worker_id, "role": w.role, "healthy": w.healthy,
                 "queued_prefill_tokens": w.queued_prefill_tokens(), "queued_prefills": len(w.prefills),
                 "running_requests": w.running_decodes(), "queue_s": round(w.queue_s(now), 4),
                 "kv_capacity_tokens": w.kv_capacity_tokens, "kv_used_tokens": w.kv_used_tokens(now, st),
                 "indexed_blocks": self.index.blocks_of(w.worker_id)} for w in self.workers.values()]
