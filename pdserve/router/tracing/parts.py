"""The child spans of a traced request, each made where its part runs with one call that is a no-op when the
request is not traced: the placement (:func:`traced_placement`, a wrapper of the router's placement), each
attempt on a worker (:func:`attempt_span`, :func:`end_attempt`, :func:`worker_headers`: the ``traceparent`` P or D
gets) and each stretch of pass-through (:func:`relay_span`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span

from ...hashing import ROOT_KEY
from ..errors import RouterError
from ..fleet.decision_log import decision_fields
from ..fleet.placement import Placement, PlacementTicket
from .request import RequestTrace, current, headers_of

if TYPE_CHECKING:
    from ..fleet.registry import WorkerRegistry

DECISION_EVENT = "pdserve.decision"  # the placement's decision (the record's fields for it) as JSON
MOVE_EVENT = "pdserve.move"  # a running decode this placement moved off its prefill worker (elastic pools)
_OFF: AbstractContextManager[None] = nullcontext()


def decision_attributes(fields: dict[str, Any]) -> dict[str, Any]:
    """A decision's fields (:func:`~..fleet.decision_log.decision_fields`) as flat span attributes."""
    out: dict[str, Any] = {f"pdserve.decision.{k}": v for k in ("kind", "prefill", "decode", "rule", "placement")
                           if (v := fields.get(k)) is not None}
    for k, v in fields.get("predicted", {}).items():
        out[f"pdserve.decision.predicted_{k}"] = v
    for k, v in fields.get("prefix_hit", {}).items():
        out[f"pdserve.decision.prefix_{k}"] = v
    out["pdserve.decision.candidates"] = len(fields.get("candidates", ()))
    return out


class TracedPlacement:
    """The router's placement with a ``placement`` span around each choice (the request's trace ``rt``); every
    other attribute is the placement's own."""

    def __init__(self, inner: Placement, rt: RequestTrace) -> None:
        self.inner = inner
        self.rt = rt
        self.registry: WorkerRegistry = inner.registry

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def choose(self, prompt_ids: Sequence[int], exclude: frozenset[str] = frozenset(), request_id: str = "",
               max_tokens: int = 16, domain: int = ROOT_KEY, whole: bool = False) -> PlacementTicket:
        rt = self.rt
        span = rt.child("placement", attributes={"pdserve.request_id": request_id,
                                                 "pdserve.prompt_tokens": len(prompt_ids),
                                                 "pdserve.max_tokens": max_tokens,
                                                 "pdserve.excluded": sorted(exclude)})
        try:
            ticket = self.inner.choose(prompt_ids, exclude, request_id, max_tokens, domain, whole)
        except RouterError as e:
            span.set_attributes({"pdserve.rejection.status": e.status, "pdserve.rejection.code": str(e.code or ""),
                                 "pdserve.rejection.message": e.message})
            rt.end(span, e.message)
            raise
        decision = getattr(ticket, "decision", None)
        if decision is not None:
            fields = decision_fields(decision)
            span.set_attributes(decision_attributes(fields))
            span.add_event(DECISION_EVENT, {"fields": json.dumps(fields, separators=(",", ":"))})
        for moved in getattr(ticket, "waits", ()):  # the moves this placement caused: linked from their own traces
            moved.cause = span.get_span_context()
            span.add_event(MOVE_EVENT, {"pdserve.move.request_id": moved.request_id,
                                        "pdserve.move.from": moved.prefill.url if moved.prefill else "",
                                        "pdserve.move.to": moved.decode.url})
        rt.end(span)
        return ticket


def traced_placement(placement: Placement) -> Placement:
    """The placement a request's run uses: ``placement`` itself unless the request is traced."""
    rt = current()
    return placement if rt is None else TracedPlacement(placement, rt)  # type: ignore[return-value]


def move_span(ticket: PlacementTicket, stopped_at: float | None) -> None:
    """A moved request's move, in its own trace (nothing untraced): from the stop on the old worker
    (``stopped_at``, perf_counter) to now, when its run takes the move's ticket; linked to the placement span of the
    request whose prefill caused it (``ticket.cause``, when that request was traced)."""
    rt = current()
    if rt is None:
        return
    cause = getattr(ticket, "cause", None)
    start = time.time_ns() - int((time.perf_counter() - stopped_at) * 1e9) if stopped_at is not None else None
    span = rt.tracer.start_span("move", context=trace.set_span_in_context(rt.root), start_time=start,
                                links=[Link(cause)] if cause is not None else None,
                                attributes={"pdserve.move.from": ticket.prefill.url if ticket.prefill else "",
                                            "pdserve.move.to": ticket.decode.url,
                                            "pdserve.move.caused_by": getattr(ticket, "caused_by", ""),
                                            "pdserve.move.reason": ticket.decision.reason})
    span.end()


def attempt_span(kind: str, role: str, url: str, request_id: str, tokens_before: int) -> Span | None:
    """The span of one attempt on a worker (None when the request is not traced): ``kind`` prefill, decode, whole
    or scored; ``tokens_before``: output tokens streamed before its placement (a migrated or moved request's later
    placements have some: the attempt continues the output)."""
    rt = current()
    if rt is None:
        return None
    name = f"{kind} attempt" if not tokens_before else f"{kind} attempt (continued)"
    return rt.child(name, attributes={"pdserve.attempt.kind": kind, "pdserve.attempt.role": role,
                                      "pdserve.worker.url": url, "pdserve.request_id": request_id,
                                      "pdserve.placement.tokens_before": tokens_before})


def worker_headers(span: Span | None) -> dict[str, Any]:
    """The worker call's keyword arguments: ``headers`` with the ``traceparent`` of ``span`` (none untraced)."""
    return {} if span is None else {"headers": headers_of(span)}


def end_attempt(span: Span, outcome: str, reason: str, tokens_out: int) -> None:
    """The attempt ended (its one log line): outcome, reason and the request's tokens out so far."""
    rt = current()
    span.set_attributes({"pdserve.attempt.outcome": outcome, "pdserve.attempt.reason": reason,
                         "pdserve.attempt.tokens_out": tokens_out})
    error = "" if outcome in ("ok", "interrupted") else f"{outcome}: {reason}"
    if rt is not None:
        rt.end(span, error)
    else:  # ended from a task outside the request's context: end it here
        span.end()


@contextmanager
def _relay(rt: RequestTrace, parent: Span, relay: Any) -> Iterator[None]:
    span = rt.child("relay", parent)
    try:
        yield
    finally:
        span.set_attributes({"pdserve.relay.events": relay.relayed, "pdserve.relay.tokens": relay.tokens})
        rt.end(span)


def relay_span(relay: Any) -> AbstractContextManager[None]:
    """A ``relay`` span (events and tokens passed through) under its attempt's span, around one ``Relay.run``; a
    shared no-op context when the request is not traced."""
    parent = getattr(relay.source, "span", None)
    rt = current() if parent is not None else None
    return _OFF if rt is None or parent is None else _relay(rt, parent, relay)
