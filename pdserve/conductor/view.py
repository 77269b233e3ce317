"""What the conductor knows of its workers and what it predicts from that: the read side every placement rule shares.

A :class:`FleetView` holds the per-worker load view (:mod:`.load`), the prefix index (:mod:`.index`), the cost
model, the clock and the settings, and answers the questions a rule asks about one worker and one request: what a
prefill there would cost (:meth:`~FleetView.prefill_options`, :meth:`~FleetView.local_ttft`), the TPOT a decode
there would see (:meth:`~FleetView.tpot_s`), whether the request's KV fits (:meth:`~FleetView.fits`), when the
worker's first decode ends (:meth:`~FleetView.drain_s`) and whether a decision misses a target
(:meth:`~FleetView.reject_reason`). It decides nothing and records nothing: the fixed-role policy
(:class:`~pdserve.conductor.policy.Conductor`, which is a FleetView), the elastic rule (:mod:`.elastic`) and the
moves (:mod:`.moves`) decide with it, so they depend on this module and not on each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .config import ConductorConfig
from .cost_model import CostModel
from .decision import Decision, PlacementRequest, PrefillOption
from .index import PrefixIndex
from .load import WorkerLoad
from .recalibration import Recalibration
from .tier_costs import TierCosts
from .tiers import DISK, HOST, POOL_DISK, POOL_MEMORY, SEP, STORE, TIERS, holder_of, split_holder

STORE_SUFFIX = SEP + STORE  # a worker's puts into a remote store: "W#store"


class FleetView:
    """The workers' load, their cached prefixes and the cost model, with the predictions made from them."""

    def __init__(self, config: ConductorConfig, cost: CostModel, clock: Callable[[], float]) -> None:
        self.config = config
        self.cost = cost
        self.clock = clock
        self.index = PrefixIndex()
        self.workers: dict[str, WorkerLoad] = {}
        self.tier_costs = TierCosts(cost.transfer_s)
        self.store_holders: set[str] = set()  # holders of a remote store's blocks (any prefill worker loads them)
        # predicted TTFT / TPOT corrected by their recent measured error (Conductor.recalibrate)
        self.recal = Recalibration(window=config.recalibration_window)
        self.prefills_seen = 0  # prefills timed since start (the recalibration waits for the model to settle)

    def forget_cache(self, worker_id: str) -> None:
        """Drop every tier ``worker_id`` holds (it left, or restarted with an empty cache)."""
        for tier in TIERS:
            h = holder_of(worker_id, tier)
            self.index.cleared(h)
            self.store_holders.discard(h)

    def own_cached(self, req: PlacementRequest, w: WorkerLoad, prefix: dict[str, int] | None = None) -> int:
        """Prompt tokens w holds already (its own prefix; at most all but the last prompt token, which vLLM
        always computes). ``prefix``: the index's prefix lengths for ``req``, when the caller has them."""
        if prefix is None:
            prefix = self.index.prefix_lengths(req.block_keys)
        return min(prefix.get(w.worker_id, 0) * self.config.block_size, max(0, req.prompt_tokens - 1))

    def prefill_options(self, req: PlacementRequest, prefill: list[WorkerLoad], prefix: dict[str, int],
                        now: float) -> list[PrefillOption]:
        """For each worker of ``prefill``, how ``req``'s prefill would run there, from the cheapest start: its own
        device prefix, or a longer one loaded from a tier (its own host or disk offload, the pool, a store) when
        the load (:class:`~.tier_costs.TierCosts`, at the tier's bandwidth) plus computing the rest is predicted
        faster; TTFT = queue + load + prefill. ``tier_pricing`` flat / device narrow the starts (the config)."""
        bs = self.config.block_size
        limit = max(0, req.prompt_tokens - 1)  # vLLM computes at least the last prompt token
        shared = self._shared_sources(req.block_keys, prefix)
        own_tiers = (HOST, DISK) if self.config.tier_pricing == "priced" else ()
        out = []
        for p in prefill:
            own = min(prefix.get(p.worker_id, 0) * bs, limit)
            cached, fetched, fetch_s, source = own, 0, 0.0, ""
            best = self.cost.prefill_s(req.prompt_tokens - own, own)
            sources = shared + [(t, prefix[h], None) for t in own_tiers
                                if (h := holder_of(p.worker_id, t)) in prefix]
            for tier, blocks, chain in sources:
                have = min(blocks * bs, limit)
                if have - own < self.config.min_fetch_blocks * bs:
                    continue
                f_s = self._load_s(tier, chain, own, have)
                total = f_s + self.cost.prefill_s(req.prompt_tokens - have, have)
                if total < best:
                    best, cached, fetched, fetch_s, source = total, have, have - own, f_s, tier
            ttft = (p.queue_s(now) + fetch_s + self.cost.prefill_s(req.prompt_tokens - cached, cached)) * \
                self.recal.factor("ttft")
            out.append(PrefillOption(p, ttft, cached, fetched, req.prompt_tokens - cached, source))
        return out

    def _load_s(self, tier: str, chain: list[str] | None, own: int, have: int) -> float:
        """Seconds to load prompt tokens [own, have) from a start: at ``tier``'s cost, or for the pool's chain at
        each block's own tier's cost (its share of the tokens per tier)."""
        kv = self.cost.kv_bytes_per_token
        if not chain:
            return self.tier_costs.load_s(tier, (have - own) * kv)
        bs = self.config.block_size
        part = chain[own // bs:-(-have // bs)] or [tier]
        return sum(self.tier_costs.load_s(t, (have - own) * part.count(t) // len(part) * kv) for t in set(part))

    def _pool_chain(self, keys: Sequence[int]) -> list[str]:
        """The tier of each leading block the ``fetchable`` holders (the pool's memory and disk) hold between them,
        memory first: a pooled prefix may start in memory and go on on SSD (the LRU spills a chain's later blocks
        first), and the pool's connector loads it whole."""
        out = []
        for k in keys:
            tier = next((split_holder(h)[1] for h in self.config.fetchable if self.index.holds(h, k)), None)
            if tier is None:
                break
            out.append(tier)
        return out

    def _shared_sources(self, keys: Sequence[int], prefix: dict[str, int]
                        ) -> list[tuple[str, int, list[str] | None]]:
        """(tier, leading blocks, the pool's per-block tiers or None) of the starts every prefill worker can load
        from: the pool's chain (named after its slowest tier; also its leading memory-only part when the chain goes
        on to SSD) and the longest of any worker's puts into a remote store. ``flat`` (as before tiers): the pool's
        chain all at the pool memory's price, and no store; ``device``: none."""
        mode = self.config.tier_pricing
        if mode == "device":
            return []
        out: list[tuple[str, int, list[str] | None]] = []
        if any(prefix.get(h, 0) for h in self.config.fetchable):
            chain = self._pool_chain(keys)
            if mode != "priced":
                chain = [POOL_MEMORY] * len(chain)
            mem = next((i for i, t in enumerate(chain) if t != POOL_MEMORY), len(chain))
            if mem < len(chain):
                out.append((POOL_DISK, len(chain), chain))
            if mem:
                out.append((POOL_MEMORY, mem, chain[:mem]))
        if mode == "priced":
            n = max((prefix.get(h, 0) for h in self.store_holders), default=0)
            if n:
                out.append((STORE, n, None))
        return out

    def tpot_s(self, d: WorkerLoad, now: float, at: float, req: PlacementRequest) -> float:
        """The decode step ``req`` would see on d from time ``at``: d's decodes predicted to still run then, plus
        ``req``."""
        step_now = self.cost.decode_step_s(max(1, d.running_decodes()), 1)
        batch, ctx = d.decode_batch_at(at, now, step_now)
        return self.cost.decode_step_s(batch + 1, ctx + req.prompt_tokens) * self.recal.factor("tpot")

    def fits(self, d: WorkerLoad, req: PlacementRequest, now: float) -> bool:
        """d has KV room for ``req``'s prompt + max_tokens (less ``kv_reserve``); True when its capacity is
        unknown (vLLM queues what does not fit)."""
        cap = d.kv_capacity_tokens
        if cap <= 0:
            return True
        used = d.kv_used_tokens(now, self.config.load_staleness_s)
        return used + req.prompt_tokens + req.max_tokens <= cap * (1 - self.config.kv_reserve)

    def local_ttft(self, req: PlacementRequest, w: WorkerLoad, now: float, prefix: dict[str, int]
                   ) -> tuple[float, int]:
        """(TTFT, cached tokens) of the whole request on w: queue + prefill, plus one decode step when w is
        decoding (a local prefill shares steps with the running decodes)."""
        cached = self.own_cached(req, w, prefix)
        extra = self.cost.decode_step_s(w.running_decodes(), 1) if w.running_decodes() else 0.0
        ttft = w.queue_s(now) + self.cost.prefill_s(req.prompt_tokens - cached, cached) + extra
        return ttft * self.recal.factor("ttft"), cached

    def drain_s(self, w: WorkerLoad, now: float) -> float:
        """Seconds until the first of w's decodes is predicted to finish (1 when it has none)."""
        step = self.cost.decode_step_s(max(1, w.running_decodes()), 1)
        return min((j.remaining_tokens * step for j in w.decodes.values()), default=1.0)

    def reject_reason(self, d: Decision, decode: list[WorkerLoad], fits: bool = True) -> Decision | None:
        """The reject (429 + Retry-After, code "slo") ``d`` turns into when it misses the TTFT or TPOT target, or,
        with a TPOT target, when no decode worker has KV room (``fits`` False); None when it meets them. The
        retry waits for ``d``'s TTFT to come within target, or for the first of ``decode``'s decodes to end."""
        cfg = self.config
        now = self.clock()
        why, wait = "", 0.0
        if cfg.ttft_slo_s is not None and d.ttft_s > cfg.ttft_slo_s:
            why = f"predicted TTFT {d.ttft_s * 1e3:.0f} ms > target {cfg.ttft_slo_s * 1e3:.0f} ms"
            wait = d.ttft_s - cfg.ttft_slo_s
        elif cfg.tpot_slo_s is not None and d.tpot_s > cfg.tpot_slo_s:
            why = f"predicted TPOT {d.tpot_s * 1e3:.1f} ms > target {cfg.tpot_slo_s * 1e3:.1f} ms"
            wait = min((self.drain_s(w, now) for w in decode), default=1.0)
        elif cfg.tpot_slo_s is not None and not fits:
            why = "no decode worker has KV room for prompt + max_tokens"
            wait = min((self.drain_s(w, now) for w in decode), default=1.0)
        if not why:
            return None
        return Decision("reject", d.request_id, d.prefill, d.decode, ttft_s=d.ttft_s, tpot_s=d.tpot_s,
                        retry_after_s=float(max(1, math.ceil(wait))), reason=why, code="slo")
