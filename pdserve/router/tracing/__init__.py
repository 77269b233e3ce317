"""OpenTelemetry traces of the router's requests (issue 40; docs/observability.md).

With ``--otlp-traces-endpoint`` set, the router (:class:`.exporter.Tracing`: the SDK's tracer provider, its batch
processor and the standard OTLP exporter) makes one span per generation request, or joins the client's
``traceparent`` (:mod:`.request`: the middleware and :class:`~.request.RequestTrace`), with child spans for
admission, each placement (the decision record's fields as attributes), each attempt on a worker (P's prefill,
D's decode, a whole request, a migrated attempt), each move of its decode off a worker (linked to the placement
that caused it) and each stretch the relay passes through (:mod:`.parts`). Each
attempt sends P or D a ``traceparent`` naming its span, so vLLM's own ``llm_request`` span (a worker started with
``--otlp-traces-endpoint``) joins the same trace. The request's whole decision record is attached to its span as
an event when it ends.

Off (no endpoint): no middleware, no tracer provider, no span; each request reads one context variable that is
None, so the cost is nothing measurable (``benchmarks/tracing_bench.py``).
"""

from .exporter import Tracing
from .parts import attempt_span, end_attempt, move_span, relay_span, traced_placement, worker_headers
from .request import RequestTrace, current, trace_middleware

__all__ = ["RequestTrace", "Tracing", "attempt_span", "current", "end_attempt", "move_span", "relay_span",
           "trace_middleware", "traced_placement", "worker_headers"]
