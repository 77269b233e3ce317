"""The connector's OpenTelemetry spans (issue 40): D's KV read from P and the pool's loads and saves, each a span
in the request's trace, under the router's attempt that called this worker (the ``traceparent`` the router sent,
which vLLM keeps on ``Request.trace_headers``; the scheduler side hands it to the worker side in the job).

Made after the fact, with the job's own start and end times, through the global tracer provider that vLLM sets up
when the worker runs with ``--otlp-traces-endpoint``. A job without a traceparent (tracing off, the request not
sampled) makes nothing."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

TRACER = "pdserve.connector"


def traceparent_of(request: Any) -> str:
    """The request's W3C traceparent as vLLM received it ("" when none)."""
    headers: Mapping[str, str] | None = getattr(request, "trace_headers", None)
    return (headers or {}).get("traceparent", "")


def kv_span(name: str, traceparent: str, start_s: float, end_s: float, attributes: Mapping[str, Any]) -> None:
    """One finished span ``name`` from ``start_s`` to ``end_s`` (wall-clock seconds) under ``traceparent``; the
    attributes' None values are left out. Nothing without a traceparent."""
    if not traceparent:
        return
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    attrs = {f"pdserve.kv.{k}": v for k, v in attributes.items() if isinstance(v, (str, bool, int, float))}
    span = trace.get_tracer(TRACER).start_span(name, context=ctx, start_time=int(start_s * 1e9), attributes=attrs)
    if attributes.get("error"):
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(attributes["error"])))
    span.end(end_time=int((end_s or time.time()) * 1e9))
