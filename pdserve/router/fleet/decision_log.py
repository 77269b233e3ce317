"""Why a request went where it went: a decision record per request, kept in a bounded in-memory ring (the newest
:data:`CAPACITY` requests) and every :data:`LOG_EVERY`-th closed record written to the log.

A record holds each placement of the request in order: the first, then any move's or migration's (each ticket is
one), with the conductor's choice (the pair, the rule that chose it, the prefix hit and its tier, the predicted TTFT
and TPOT; under ``--policy conductor``'s fixed roles every candidate weighed, with its prediction and prefix hit)
and what the ticket measured; or the rejection with its reason. GET /v1/pdserve/decisions/{request_id}
(:mod:`pdserve.router.endpoints.decisions`) answers it.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ...conductor import Decision
from .prediction_error import Measured

log = logging.getLogger("pdserve.router.decisions")

CAPACITY = 4096  # requests whose records are kept (the oldest go first)
LOG_EVERY = 100  # one closed record in this many is logged (INFO, logger pdserve.router.decisions); 0: none


def decision_fields(d: Decision) -> dict[str, Any]:
    """The conductor's choice as the record shows it."""
    out: dict[str, Any] = {"kind": d.kind, "prefill": d.prefill, "decode": d.decode, "rule": d.reason,
                           "predicted": {"ttft_s": round(d.ttft_s, 6), "tpot_s": round(d.tpot_s, 6)},
                           "prefix_hit": {"cached_tokens": d.cached_tokens, "fetch_tokens": d.fetch_tokens,
                                          "fetch_tier": d.fetch_tier}}
    if d.ttft_factor != 1.0 or d.tpot_factor != 1.0:  # recalibrated: the factors and the model's own figures
        out["recalibration"] = {"ttft_factor": round(d.ttft_factor, 4), "tpot_factor": round(d.tpot_factor, 4),
                                "uncorrected": {"ttft_s": round(d.ttft_s / d.ttft_factor, 6),
                                                "tpot_s": round(d.tpot_s / d.tpot_factor, 6)}}
    if d.placement:
        out["placement"] = d.placement
    if d.candidates:
        out["candidates"] = [{**c._asdict(), "predicted_s": round(c.predicted_s, 6)} for c in d.candidates]
    if d.kind == "reject":
        out["rejection"] = {"code": d.code, "retry_after_s": d.retry_after_s}
    return out


def _s(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


class DecisionLog:
    """The ring of records, by request id. Only the router's event loop writes it (no lock)."""

    def __init__(self, capacity: int = CAPACITY, log_every: int = LOG_EVERY,
                 clock: Callable[[], float] = time.time) -> None:
        self.capacity = capacity
        self.log_every = log_every
        self.clock = clock  # each placement's ``at``: wall-clock seconds when it closed (or was rejected)
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._closed = 0

    def _record(self, request_id: str, policy: str) -> dict[str, Any]:
        rec = self._records.get(request_id)
        if rec is None:
            rec = self._records[request_id] = {"request_id": request_id, "policy": policy, "placements": []}
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        return rec

    def rejected(self, request_id: str, policy: str, decision: Decision, excluded: frozenset[str]) -> None:
        """The conductor refused the request (429)."""
        rec = self._record(request_id, policy)
        rec["placements"].append({**decision_fields(decision), "excluded": sorted(excluded),
                                  "at": round(self.clock(), 3)})
        self._done(rec)

    def closed(self, request_id: str, policy: str, decision: Decision, excluded: frozenset[str], measured: Measured,
               moved: bool) -> None:
        """One placement of the request ended (its ticket closed or was handed over to a move); ``moved``: it was a
        move's placement rather than the router's own."""
        rec = self._record(request_id, policy)
        n = len(rec["placements"])
        why = "move" if moved else ("first" if n == 0 else "migration")
        rec["placements"].append({**decision_fields(decision), "why": why, "excluded": sorted(excluded),
                                  "measured": {"ttft_s": _s(measured.ttft_s), "tpot_s": _s(measured.tpot_s)},
                                  "at": round(self.clock(), 3)})
        self._done(rec)

    def replayed(self, request_id: str, verdict: dict[str, Any]) -> None:
        """The false-refusal replay's verdict on the request's rejection (:mod:`pdserve.conductor.refusal_replay`),
        kept under the rejection's ``replay``."""
        rec = self._records.get(request_id)
        for p in reversed(rec["placements"] if rec is not None else []):
            if p.get("kind") == "reject":
                p["replay"] = verdict
                return

    def _done(self, rec: dict[str, Any]) -> None:
        self._closed += 1
        if self.log_every and self._closed % self.log_every == 0:
            log.info("decision %s", json.dumps(rec, separators=(",", ":")))

    def placements_since(self, t: float) -> list[dict[str, Any]]:
        """Every placement (or rejection) the ring holds that closed at ``t`` or later (wall-clock seconds)."""
        return [p for rec in self._records.values() for p in rec["placements"] if p.get("at", 0.0) >= t]

    def recent(self, n: int) -> list[dict[str, Any]]:
        """The newest ``n`` records, newest first."""
        out: list[dict[str, Any]] = []
        for rec in reversed(self._records.values()):
            if len(out) == n:
                break
            out.append(rec)
        return out

    def record(self, request_id: str) -> dict[str, Any] | None:
        """The record of exactly this request id (one choice's), or None."""
        return self._records.get(request_id)

    def get(self, request_id: str) -> dict[str, Any] | None:
        """The request's record; for a request with several choices (``n``, prompt lists: ids ``{id}-{i}``), theirs
        under ``choices``. None when the ring holds nothing of it."""
        rec = self._records.get(request_id)
        if rec is not None:
            return rec
        subs: list[dict[str, Any]] = []
        while (sub := self._records.get(f"{request_id}-{len(subs)}")) is not None:
            subs.append(sub)
        return {"request_id": request_id, "choices": subs} if subs else None
