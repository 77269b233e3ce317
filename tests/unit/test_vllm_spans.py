"""The connector's spans (pdserve/vllm/spans.py): a finished span under the request's traceparent with the job's
times and figures, through the process's global tracer provider; nothing without a traceparent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.vllm.spans import kv_span, traceparent_of

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    trace.set_tracer_provider(provider)  # as vLLM does in a worker started with --otlp-traces-endpoint
    if trace.get_tracer_provider() is not provider:
        pytest.skip("this process already has a global tracer provider")
    return mem


def test_a_read_becomes_a_span_of_the_request(spans):
    spans.clear()
    kv_span("pdserve.kv_read", PARENT, 100.0, 100.25, {"bytes": 4096, "blocks": 2, "ok": True, "peers": [0],
                                                       "error": None})
    (s,) = spans.get_finished_spans()
    assert s.name == "pdserve.kv_read" and f"{s.context.trace_id:032x}" == PARENT.split("-")[1]
    assert f"{s.parent.span_id:016x}" == PARENT.split("-")[2]
    assert (s.start_time, s.end_time) == (100_000_000_000, 100_250_000_000)
    assert dict(s.attributes) == {"pdserve.kv.bytes": 4096, "pdserve.kv.blocks": 2, "pdserve.kv.ok": True}


def test_a_failed_job_is_an_error_and_no_traceparent_makes_nothing(spans):
    spans.clear()
    kv_span("pdserve.pool_load", "", 1.0, 2.0, {"bytes": 1})
    assert spans.get_finished_spans() == ()
    kv_span("pdserve.pool_load", PARENT, 1.0, 2.0, {"bytes": 0, "error": "node gone"})
    (s,) = spans.get_finished_spans()
    assert s.status.status_code == trace.StatusCode.ERROR and s.status.description == "node gone"


def test_traceparent_of_a_request():
    assert traceparent_of(SimpleNamespace(trace_headers={"traceparent": PARENT})) == PARENT
    assert traceparent_of(SimpleNamespace(trace_headers=None)) == "" == traceparent_of(object())
