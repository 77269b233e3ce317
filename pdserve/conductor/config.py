"""Conductor settings: one frozen dataclass, validated with messages that say how to fix a value."""

from __future__ import annotations

from dataclasses import dataclass

from ..rules import POLICIES, check_local_prefill_tokens, check_policy, check_slo

__all__ = ["POLICIES", "ConductorConfig", "ConductorConfigError"]


class ConductorConfigError(ValueError):
    """A conductor setting is wrong; the message says which and how to fix it."""


@dataclass(frozen=True)
class ConductorConfig:
    """policy: ``conductor`` (prefix + load + SLO aware), ``least_loaded`` or ``round_robin`` (baselines).
    block_size: tokens per KV block, as the workers use (vLLM on CPU: 128); block keys use the same size.
    ttft_slo_s / tpot_slo_s: targets; a request whose best predicted TTFT (or TPOT) misses its target is
        rejected (429 + Retry-After). None: never reject on that measure.
    local_prefill_tokens: run the whole request on the decode worker when its uncached prompt is at most this
        many tokens. None: learned, i.e. local while computing the prompt on D costs less than the hand-off and
        the KV transfer would, and D's running decodes can absorb the stall (``local_stall_s``).
    local_stall_s: the longest prefill a decode worker may run locally while it has running decodes.
    fetchable: holders whose blocks a prefill worker can load instead of computing (the KV pool's tiers).
    min_fetch_blocks: fetch a pooled prefix only when it is at least this many blocks longer than P's own.
    load_staleness_s: worker-reported load older than this is ignored (our own accounting is used).
    kv_reserve: fraction of each worker's KV kept free when checking that a request fits.
    max_inflight_per_worker: at most this many placed requests per worker (prefills queued and decodes running
        there); a request whose candidates are all at the limit is rejected (429 + Retry-After). None: no limit.
    chunk_tokens: the workers' per-step token budget (vLLM ``--max-num-batched-tokens``; vLLM V1 always chunks
        prefills to it). Elastic placement then models a prefill on a decoding worker as chunked into its decode
        steps (:mod:`.elastic`). None: unknown, a prefill is modelled as one step that stalls the decodes batched
        with it for its whole length.
    split_harm_handoffs: elastic placement calls a prefill long (the new decode leaves its worker) only when its
        harm to the decodes it stalls is over this many hand-offs (:mod:`.elastic`). The default 1 splits
        whenever the stall costs the decodes more than the hand-off costs the request; 2 keeps a 100-token prompt
        on one CPU core (~0.1 s, against a ~60-100 ms hand-off) colocated next to one decode, which spread the
        decodes but measured a worse TPOT tail on the 2-core mixed workload (docs/bench.md, "Retuning").
    """

    policy: str = "conductor"
    block_size: int = 128
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    local_prefill_tokens: int | None = None
    local_stall_s: float = 0.05
    fetchable: tuple[str, ...] = ("pool",)
    min_fetch_blocks: int = 1
    load_staleness_s: float = 3.0
    kv_reserve: float = 0.02
    max_inflight_per_worker: int | None = None
    chunk_tokens: int | None = None
    split_harm_handoffs: float = 1.0

    def __post_init__(self) -> None:
        check_policy(self.policy, "policy", ConductorConfigError)
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ConductorConfigError(f"block_size={self.block_size!r}: give the workers' KV block size in "
                                       "tokens (vLLM on CPU uses 128)")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            check_slo(getattr(self, name), name, "seconds", ConductorConfigError)
        check_local_prefill_tokens(self.local_prefill_tokens, "local_prefill_tokens", ConductorConfigError)
        if self.local_stall_s < 0 or self.load_staleness_s <= 0:
            raise ConductorConfigError("local_stall_s must be >= 0 and load_staleness_s > 0 (seconds)")
        if self.min_fetch_blocks < 1:
            raise ConductorConfigError(f"min_fetch_blocks={self.min_fetch_blocks}: use >= 1")
        if not 0 <= self.kv_reserve < 1:
            raise ConductorConfigError(f"kv_reserve={self.kv_reserve}: a fraction in [0, 1)")
        limit = self.max_inflight_per_worker
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConductorConfigError(f"max_inflight_per_worker={limit!r}: a request count >= 1, or None for "
                                       "no per-worker limit")
        chunk = self.chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ConductorConfigError(f"chunk_tokens={chunk!r}: the workers' --max-num-batched-tokens (tokens per "
                                       "step, >= 1), or None when unknown")
        k = self.split_harm_handoffs
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not k > 0:
            raise ConductorConfigError(f"split_harm_handoffs={k!r}: a positive number of hand-offs (1, the default: "
                                       "split when the stall costs more than one hand-off)")
        object.__setattr__(self, "fetchable", tuple(self.fetchable))
