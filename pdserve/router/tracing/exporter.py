"""The router's tracer provider: the OpenTelemetry SDK's ``TracerProvider`` with a ``BatchSpanProcessor`` over the
standard OTLP span exporter, one per router process (built at start, flushed and shut down at stop).

The protocol follows vLLM's rule, so one endpoint serves both: gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
says ``http/protobuf`` (then the endpoint is the collector's full ``/v1/traces`` URL). The sampler follows a
client's ``traceparent`` and otherwise traces ``otlp_traces_sample_ratio`` of the requests.
"""

from __future__ import annotations

import os

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Tracer

from ..config import RouterConfig, RouterConfigError

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # the SDK's (and vLLM's) variable: grpc | http/protobuf
SERVICE = "pdserve-router"
EXPORT_TIMEOUT_S = 5  # one export's limit: a collector that does not answer delays the router's stop this long


def span_exporter(endpoint: str) -> SpanExporter:
    """The SDK's OTLP exporter for ``endpoint`` in the protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` names."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=EXPORT_TIMEOUT_S)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
    raise RouterConfigError(f"{PROTOCOL_ENV}={protocol!r}: the router exports traces over grpc or http/protobuf "
                            "(as vLLM does); set one of those or unset it")


class Tracing:
    """The tracer of one router process (see the module docstring); :meth:`close` flushes what is queued."""

    def __init__(self, endpoint: str, sample_ratio: float = 1.0, exporter: SpanExporter | None = None) -> None:
        resource = Resource.create({"service.name": SERVICE, "process.pid": os.getpid()})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or span_exporter(endpoint)))
        self.tracer: Tracer = self.provider.get_tracer("pdserve.router")
        self.endpoint = endpoint

    @classmethod
    def of(cls, config: RouterConfig) -> Tracing | None:
        """The router's tracing, or None when ``--otlp-traces-endpoint`` is empty (tracing off)."""
        if not config.otlp_traces_endpoint:
            return None
        return cls(config.otlp_traces_endpoint, config.otlp_traces_sample_ratio)

    def close(self) -> None:
        """Export what is queued (blocking: call it off the event loop) and stop the exporter."""
        self.provider.shutdown()
