"""Where a request runs. The router asks a :class:`Placement` and gets a
:class:`~pdserve.router.fleet.ticket.PlacementTicket`; :class:`ConductorPlacement` adapts the conductor
(:mod:`pdserve.conductor`: round-robin, least-loaded, or prefix/load/SLO-aware) to the router's
:class:`~pdserve.router.fleet.registry.WorkerRegistry` and turns its verdicts into HTTP errors (503 no worker, 429
with Retry-After when the targets cannot be met).

The conductor's view of the workers follows the registry (it listens to membership and health changes); the
ticket owns the request's lifecycle from the decision to its release.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from ...conductor import Conductor, ConductorConfig, Decision, OnlineCostModel, PlacementRequest
from ...conductor.decision import NoWorker
from ...conductor.moves import MoveConfig
from ...conductor.refusal_replay import Neighbour, Refusal, RefusalReplay, Verdict
from ...hashing import ROOT_KEY, block_hashes
from ..errors import RouterError, unavailable
from ..workers.client import Worker
from .decision_log import DecisionLog
from .move import Movers, move_off
from .prediction_error import PredictionErrors
from .registry import WorkerRegistry, role_of
from .ticket import PlacementTicket

__all__ = ["ConductorPlacement", "Placement", "PlacementTicket", "make_placement", "role_of",
           "too_busy"]


class Placement(Protocol):
    registry: WorkerRegistry

    def choose(self, prompt_ids: Sequence[int], exclude: frozenset[str] = frozenset(), request_id: str = "",
               max_tokens: int = 16, domain: int = ROOT_KEY, whole: bool = False) -> PlacementTicket: ...


def too_busy(d: Decision) -> RouterError:
    code = "worker_limit" if d.code == "worker_limit" else "slo_unattainable"
    return RouterError(429, f"Server is busy: {d.reason}. Retry after {d.retry_after_s:.0f} s.", "rate_limit_error",
                       None, code, headers={"Retry-After": str(int(d.retry_after_s))})


class ConductorPlacement:
    """The router's placement for every policy; listens to ``registry`` so the conductor knows every member and
    its health at the moment either changes."""

    def __init__(self, conductor: Conductor, registry: WorkerRegistry, moves: MoveConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.conductor = conductor
        self.clock = clock  # the tickets' clock: they time their placement's first token and TPOT on it
        self.registry = registry
        self.moves = moves or MoveConfig()  # moving running decodes off a worker that starts a prefill (elastic)
        self.movers = Movers()  # the running generations, by request id
        self._ids = itertools.count()
        self.decision_seconds: deque[float] = deque(maxlen=4096)  # recent decision times, for the metrics
        self.errors: PredictionErrors | None = None  # the predictions' error, reported by each ticket it closes
        self.decisions = DecisionLog()  # a decision record per request (GET /v1/pdserve/decisions/{request_id})
        # the early rejections judged by the requests placed beside them (false refusals)
        self.refusals = RefusalReplay(clock)
        self.refusals.on_verdict.append(self._verdict)
        # told (the worker that computes the prompt, its block keys) of every placement: the placeholders
        # shared through the KV indexer (:mod:`.placeholders`)
        self.on_placed: list[Callable[[str, Sequence[int]], None]] = []
        registry.subscribe(self)

    # ---- RegistryListener ----
    def worker_added(self, worker: Worker) -> None:
        self.conductor.add_worker(worker.url, role_of(worker.roles), 0)
        if not worker.healthy:
            self.conductor.set_health(worker.url, False)

    def worker_removed(self, url: str) -> None:
        self.conductor.remove_worker(url)

    def health_changed(self, worker: Worker) -> None:
        self.conductor.set_health(worker.url, worker.healthy)

    # ---- the decision ----
    def choose(self, prompt_ids: Sequence[int], exclude: frozenset[str] = frozenset(), request_id: str = "",
               max_tokens: int = 16, domain: int = ROOT_KEY, whole: bool = False) -> PlacementTicket:
        """A ticket for the request (close it whatever happens), or RouterError 503 / 429. ``domain``: the root of
        the request's block keys (:func:`pdserve.hashing.domain_root` of its cache salt and adapter), so it is
        placed by the blocks of its own domain only. ``whole``: the request runs whole on one worker that decodes
        (beam search, :mod:`..run.beam_search`; the conductor's ``PlacementRequest.whole``)."""
        t0 = time.perf_counter()
        c = self.conductor
        rid = request_id or f"req-{next(self._ids)}"
        keys = block_hashes(prompt_ids, c.config.block_size, domain) if c.config.policy == "conductor" else ()
        try:
            d = c.place(PlacementRequest(rid, len(prompt_ids), keys, max_tokens, whole), exclude)
        except NoWorker as e:
            detail = "; ".join(f"{w.url}: {w.last_error or ('excluded' if w.url in exclude else 'not taking requests')}"
                               for w in self.registry if e.role in w.roles or e.role == "any" or
                               (e.role == "decode" and "colocated" in w.roles))
            what = "worker" if e.role == "any" else f"{e.role} worker"
            raise unavailable(f"no healthy {what} ({detail or 'none registered'})") from None
        finally:
            self.decision_seconds.append(time.perf_counter() - t0)
        now = self.clock()
        if d.kind == "reject":
            self.decisions.rejected(rid, c.config.policy, d, exclude)
            if d.code == "slo" and not exclude:
                self.refusals.refused(refusal(c.config, d, rid, now, len(prompt_ids), max_tokens))
            raise too_busy(d)
        return self._ticket(d, keys, len(prompt_ids), max_tokens, exclude, now)

    def choose_on(self, prompt_ids: Sequence[int], prefill: str | None, decode: str, reason: str,
                  request_id: str = "", max_tokens: int = 16, domain: int = ROOT_KEY) -> PlacementTicket:
        """A ticket on workers named from outside (:mod:`.sidecar`: the pair a gateway's picker chose): P
        ``prefill`` -> D ``decode``, or the whole request on ``decode`` (``prefill`` None); everything after the
        choice (reservation, record, release) as :meth:`choose`'s. RouterError 503 when a named worker left."""
        t0 = time.perf_counter()
        c = self.conductor
        rid = request_id or f"req-{next(self._ids)}"
        keys = block_hashes(prompt_ids, c.config.block_size, domain) if c.config.policy == "conductor" else ()
        try:
            d = c.place_on(PlacementRequest(rid, len(prompt_ids), keys, max_tokens), prefill, decode, reason)
        except NoWorker as e:
            raise unavailable(str(e)) from None
        finally:
            self.decision_seconds.append(time.perf_counter() - t0)
        return self._ticket(d, keys, len(prompt_ids), max_tokens, frozenset(), self.clock())

    def _ticket(self, d: Decision, keys: Sequence[int], prompt_tokens: int, max_tokens: int,
                exclude: frozenset[str], now: float) -> PlacementTicket:
        """The ticket of decision ``d`` (placed, not rejected): the neighbour the refusal replay judges by, the
        placeholders, the record and, elastic, the moves it causes."""
        c, rid = self.conductor, d.request_id
        ticket = PlacementTicket(c, self.registry, d, self.clock)
        computes = d.prefill if d.kind == "disaggregated" else d.decode
        if not exclude and computes is not None and d.decode is not None:  # a first placement: a neighbour
            self.refusals.placed(rid, Neighbour(now, computes, d.decode, prompt_tokens - d.cached_tokens,
                                                prompt_tokens, prompt_tokens + max_tokens))
        if computes is not None:
            for placed in self.on_placed:
                placed(computes, keys)
        ticket.errors, ticket.decisions, ticket.excluded = self.errors, self.decisions, exclude
        ticket.refusals = self.refusals
        if d.placement and self.moves.enabled and self.movers:  # elastic: move the decodes that pay
            ticket.waits = tuple(move_off(c, self.registry, self.movers, self.moves, rid))
            ticket.wait_s = self.moves.wait_s
            for moved in ticket.waits:  # a move's placement reports its error and its record as any other
                moved.errors, moved.decisions, moved.caused_by = self.errors, self.decisions, rid
        return ticket


    def _verdict(self, request_id: str, v: Verdict) -> None:
        self.decisions.replayed(request_id, v.as_dict())


def refusal(config: ConductorConfig, d: Decision, request_id: str, at: float, prompt_tokens: int,
            max_tokens: int) -> Refusal:
    """The early rejection ``d`` as the replay judges it: the target it missed (checked in the conductor's order:
    TTFT, TPOT, else KV room) and the worker whose queue or batch it was refused for."""
    if config.ttft_slo_s is not None and d.ttft_s > config.ttft_slo_s:
        target, target_s, worker = "ttft", config.ttft_slo_s, d.prefill or d.decode or ""
    elif config.tpot_slo_s is not None and d.tpot_s > config.tpot_slo_s:
        target, target_s, worker = "tpot", config.tpot_slo_s, d.decode or ""
    else:
        target, target_s, worker = "kv", 0.0, d.decode or ""
    return Refusal(request_id, at, target, target_s, worker, prompt_tokens - d.cached_tokens, prompt_tokens,
                   prompt_tokens + max_tokens)


def make_placement(registry: WorkerRegistry, config: ConductorConfig, kv_bytes_per_token: int,
                   moves: MoveConfig | None = None) -> ConductorPlacement:
    return ConductorPlacement(Conductor(config, OnlineCostModel(kv_bytes_per_token)), registry, moves)

