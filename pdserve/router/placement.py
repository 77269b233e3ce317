"""Where a request runs. The router asks a :class:`Placement`; :class:`ConductorPlacement` adapts the
conductor (:mod:`pdserve.conductor`: round-robin, least-loaded, or prefix/load/SLO-aware) to the router's
:class:`~pdserve.router.workers.Worker` objects and turns its verdicts into HTTP errors (503 no worker, 429
with Retry-After when the targets cannot be met).

Every choice must be closed with :meth:`Placement.finished` (the conductor reserves queue and KV for it);
:meth:`prefill_done` and :meth:`progress` keep its load view and cost model current.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

from ..conductor import Conductor, ConductorConfig, Decision, OnlineCostModel, PlacementRequest
from ..conductor.policy import NoWorker
from ..hashing import block_hashes
from .errors import RouterError, unavailable
from .workers import Worker


@dataclass(frozen=True)
class Choice:
    """decode always set; prefill None means "run the whole request on decode" (colocated/decode-local)."""

    decode: Worker
    prefill: Worker | None = None
    request_id: str = ""
    decision: Decision | None = None


class Placement(Protocol):
    def choose(self, prompt_ids: Sequence[int], exclude: frozenset[str] = frozenset(), request_id: str = "",
               max_tokens: int = 16) -> Choice: ...

    def prefill_done(self, choice: Choice) -> None: ...

    def progress(self, choice: Choice, tokens: int) -> None: ...

    def finished(self, choice: Choice) -> None: ...


def role_of(roles: set[str]) -> str:
    if "colocated" in roles:
        return "colocated"
    if {"prefill", "decode"} <= roles:
        return "both"
    return next(iter(roles))


def too_busy(d: Decision) -> RouterError:
    return RouterError(429, f"Server is busy: {d.reason}. Retry after {d.retry_after_s:.0f} s.", "rate_limit_error",
                       None, "slo_unattainable", headers={"Retry-After": str(int(d.retry_after_s))})


class ConductorPlacement:
    """The router's placement for every policy; the workers dict is shared with the router (membership)."""

    def __init__(self, conductor: Conductor, workers: dict[str, Worker]) -> None:
        self.conductor = conductor
        self.workers = workers
        self._ids = itertools.count()
        self.decision_seconds: deque[float] = deque(maxlen=4096)  # recent decision times, for the metrics
        for w in workers.values():
            self.add(w)

    def add(self, w: Worker, kv_capacity_tokens: int = 0) -> None:
        self.workers[w.url] = w
        self.conductor.add_worker(w.url, role_of(w.roles), kv_capacity_tokens)

    def remove(self, url: str) -> Worker | None:
        self.conductor.remove_worker(url)
        return self.workers.pop(url, None)

    def choose(self, prompt_ids: Sequence[int], exclude: frozenset[str] = frozenset(), request_id: str = "",
               max_tokens: int = 16) -> Choice:
        t0 = time.perf_counter()
        c = self.conductor
        for url, w in self.workers.items():
            lw = c.workers.get(url)
            if lw is not None and lw.healthy != w.healthy:
                c.set_health(url, w.healthy)
        rid = request_id or f"req-{next(self._ids)}"
        keys = block_hashes(prompt_ids, c.config.block_size) if c.config.policy == "conductor" else ()
        try:
            d = c.place(PlacementRequest(rid, len(prompt_ids), keys, max_tokens), exclude)
        except NoWorker as e:
            detail = "; ".join(f"{w.url}: {w.last_error or ('excluded' if w.url in exclude else 'not taking requests')}"
                               for w in self.workers.values() if e.role in w.roles or
                               (e.role == "decode" and "colocated" in w.roles))
            raise unavailable(f"no healthy {e.role} worker ({detail or 'none registered'})") from None
        finally:
            self.decision_seconds.append(time.perf_counter() - t0)
        if d.kind == "reject":
            raise too_busy(d)
        assert d.decode is not None
        return Choice(decode=self.workers[d.decode], prefill=self.workers[d.prefill] if d.prefill else None,
                      request_id=rid, decision=d)

    def prefill_done(self, choice: Choice) -> None:
        self.conductor.prefill_done(choice.request_id)

    def progress(self, choice: Choice, tokens: int) -> None:
        self.conductor.decode_progress(choice.request_id, tokens)

    def finished(self, choice: Choice) -> None:
        self.conductor.finished(choice.request_id)


def make_placement(workers: dict[str, Worker], config: ConductorConfig, kv_bytes_per_token: int) -> ConductorPlacement:
    return ConductorPlacement(Conductor(config, OnlineCostModel(kv_bytes_per_token)), workers)


class RoundRobin(ConductorPlacement):
    """Round-robin over prefill workers and, independently, decode workers (or colocated workers)."""

    def __init__(self, prefill: Sequence[Worker], decode: Sequence[Worker], colocated: Sequence[Worker]) -> None:
        workers: dict[str, Worker] = {}
        for role, ws in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
            for w in ws:
                w.roles.add(role)
                workers[w.url] = w
        super().__init__(Conductor(ConductorConfig(policy="round_robin"), OnlineCostModel(0)), workers)
