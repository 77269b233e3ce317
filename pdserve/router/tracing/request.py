"""One request's trace: the span the router makes per generation request (or the client's ``traceparent``
joined), held in a context variable for the request's handler and the tasks it starts, and the middleware that
owns it (starts it, ends it with the answer's status and the request's decision record).

Child spans take their parent explicitly (:meth:`RequestTrace.child`), never from OpenTelemetry's implicit current
context: a request's run is a chain of async generators, and a context set inside one would leak into its caller
across a ``yield``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .exporter import Tracing

# the generation endpoints: each request there gets a span (the rest of the API is not traced)
TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})
RECORD_EVENT = "pdserve.decision_record"  # the event holding the request's whole decision record (JSON)
CLIENT_LEFT = 499  # the status a request whose client left is recorded with (no answer was written)
_PROPAGATOR = TraceContextTextMapPropagator()
_CURRENT: ContextVar[RequestTrace | None] = ContextVar("pdserve_request_trace", default=None)

DecisionsOf = Callable[[str], "dict[str, Any] | None"]  # request id -> its decision record (the router's ring)


def current() -> RequestTrace | None:
    """The trace of the request being handled in this task, or None (tracing off, another endpoint, unsampled)."""
    return _CURRENT.get()


class RequestTrace:
    """The spans of one request: ``root`` (the request), ``admission`` while the request is admitted and its choices
    built, and every child span still open (ended with the root at the latest)."""

    def __init__(self, tracer: trace.Tracer, root: Span) -> None:
        self.tracer = tracer
        self.root = root
        self.request_id = ""
        self.open: set[Span] = set()
        self.admission: Span | None = self.child("admission")

    def child(self, name: str, parent: Span | None = None, attributes: Mapping[str, Any] | None = None) -> Span:
        """A span under ``parent`` (default: the request's), open until :meth:`end` or the request's end."""
        ctx = trace.set_span_in_context(parent or self.root)
        span = self.tracer.start_span(name, context=ctx, attributes=attributes)
        self.open.add(span)
        return span

    def end(self, span: Span, error: str = "") -> None:
        """End ``span`` once (an error description sets its status)."""
        if span not in self.open:
            return
        self.open.discard(span)
        if getattr(span, "end_time", None) is not None:  # ended already (end_attempt outside this context)
            return
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def admitted(self, request_id: str, choices: int, prompt_tokens: int) -> None:
        """The request is admitted and its choices built: the admission span ends."""
        self.request_id = request_id
        self.root.set_attribute("pdserve.request_id", request_id)
        if self.admission is not None:
            self.admission.set_attributes({"pdserve.choices": choices, "pdserve.prompt_tokens": prompt_tokens})
            self.end(self.admission)
            self.admission = None

    def finish(self, status: int, decisions: DecisionsOf | None) -> None:
        """The answer is written: every span still open ends, the decision record goes on the request's span."""
        for span in list(self.open):
            self.end(span, "" if span is not self.admission else f"refused: HTTP {status}")
        root = self.root
        root.set_attribute("http.response.status_code", status)
        if status >= 500 and status != CLIENT_LEFT:
            root.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        record = decisions(self.request_id) if decisions is not None and self.request_id else None
        if record is not None:
            root.add_event(RECORD_EVENT, {"record": json.dumps(record, separators=(",", ":"))})
        root.end()


def headers_of(span: Span) -> dict[str, str]:
    """The W3C ``traceparent`` (and ``tracestate``) naming ``span``: what P or D gets so vLLM's spans join it."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def trace_middleware(tracing: Tracing, decisions: DecisionsOf | None) -> Any:
    """The aiohttp middleware (outermost) that owns each generation request's trace: its span, joined to the
    client's ``traceparent`` when it sends one, ended when the answer is written."""
    tracer = tracing.tracer

    @web.middleware
    async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or request.path not in TRACED_PATHS:
            return await handler(request)
        parent = _PROPAGATOR.extract(request.headers)
        root = tracer.start_span(f"POST {request.path}", context=parent, kind=SpanKind.SERVER,
                                 attributes={"http.request.method": "POST", "url.path": request.path})
        if not root.is_recording():  # not sampled: nothing to record, nothing to send on
            root.end()
            return await handler(request)
        rt = RequestTrace(tracer, root)
        token = _CURRENT.set(rt)
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except asyncio.CancelledError:
            status = CLIENT_LEFT
            raise
        finally:
            _CURRENT.reset(token)
            rt.finish(status, decisions)

    return traced
