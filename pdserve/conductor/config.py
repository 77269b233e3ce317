"""Conductor settings: one frozen dataclass. Its fields, defaults and checks come from the table of settings
(:mod:`pdserve.settings`): what the router hands on (``policy``, the SLO targets in seconds, ...) and what only
the conductor has (``local_stall_s``, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import POLICIES, ConfigError, check_fields
from ..settings.targets import settings_of, target_default

__all__ = ["POLICIES", "ConductorConfig", "ConductorConfigError"]

_SETTINGS = settings_of("conductor")


def _d(field: str) -> Any:  # the table's default
    return target_default("conductor", field)


class ConductorConfigError(ConfigError):
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
    fetchable: holders whose blocks any prefill worker can load instead of computing (the KV pool's memory and
        disk tiers; a worker's own host and disk offload and any worker's remote-store puts are added per worker,
        :meth:`~.view.FleetView.prefill_options`).
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
    recalibration_window: the recent placements whose measured error corrects the predicted TTFT
        (:mod:`.recalibration`: half way to the median error over them, when one-sided; 0: off).
    tier_pricing: how a prefill worker's start is priced (:meth:`~.view.FleetView.prefill_options`): ``priced``,
        each tier at its own bandwidth (:mod:`.tier_costs`); ``flat``, as before tiers: the ``fetchable``
        holders alike at the pool memory's price, no offload or store tiers; ``device``, the worker's own device
        prefix only (nothing fetchable counted).
    replicas: router replicas placing on the same workers. Above 1, what a worker reports (vLLM /metrics: running
        and waiting requests) beyond what this replica placed there counts as the other replicas' load
        (:meth:`pdserve.conductor.load.WorkerLoad.merge_report`, docs/conductor.md "Router replicas").
    """

    policy: str = _d("policy")
    block_size: int = _d("block_size")
    ttft_slo_s: float | None = _d("ttft_slo_s")
    tpot_slo_s: float | None = _d("tpot_slo_s")
    local_prefill_tokens: int | None = _d("local_prefill_tokens")
    local_stall_s: float = _d("local_stall_s")
    fetchable: tuple[str, ...] = ("pool", "pool#pool_disk")
    min_fetch_blocks: int = _d("min_fetch_blocks")
    load_staleness_s: float = _d("load_staleness_s")
    kv_reserve: float = _d("kv_reserve")
    max_inflight_per_worker: int | None = _d("max_inflight_per_worker")
    chunk_tokens: int | None = _d("chunk_tokens")
    split_harm_handoffs: float = _d("split_harm_handoffs")
    replicas: int = _d("replicas")
    recalibration_window: int = _d("recalibration_window")
    tier_pricing: str = _d("tier_pricing")

    def __post_init__(self) -> None:
        check_fields(self, _SETTINGS, ConductorConfigError)
        if not isinstance(self.fetchable, tuple) or not all(isinstance(f, str) for f in self.fetchable):
            raise ConductorConfigError(f"fetchable={self.fetchable!r}: a tuple of holder names, e.g. ('pool',)")
