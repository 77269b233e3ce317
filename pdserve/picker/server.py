"""The picker's gRPC service: Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor``, one ``Process`` stream per
HTTP request the gateway forwards (the stubs of the ``xds-protos`` package: Envoy's published definitions)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..router.errors import RouterError
from ..router.fleet.ticket import PlacementTicket
from . import protocol
from .picker import Picker, host_port

log = logging.getLogger("pdserve.picker")

MAX_BODY = 64 << 20  # a buffered request body larger than this is refused


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, destination_port: int = 0) -> None:
        self.picker = picker
        self.destination_port = destination_port  # the decode pods' routing sidecar (0: the decode worker itself)

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (Envoy's name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        body = bytearray()
        ticket: PlacementTicket | None = None
        streamed_request = streamed_response = False  # FULL_DUPLEX_STREAMED (protocol.py)
        subset: list[str] | None = None  # the gateway's allowed endpoints (None: the whole pool)
        try:
            async for req in request_iterator:
                if subset is None and req.HasField("metadata_context"):
                    subset = protocol.subset_of(req)
                if req.HasField("protocol_config"):  # Envoy's body modes, in the stream's first message
                    streamed_request = req.protocol_config.request_body_mode == protocol.STREAMED
                    streamed_response = req.protocol_config.response_body_mode == protocol.STREAMED
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    if req.request_headers.end_of_stream:  # no body (a GET): nothing to place by
                        yield protocol.refused(400, "the picker places requests with an OpenAI JSON body",
                                               "invalid_body")
                        return
                    if not streamed_request:  # streamed: the headers' answer carries the endpoint, after the body
                        yield protocol.carry_on(kind)
                elif kind == "request_body":
                    body += req.request_body.body
                    if len(body) > MAX_BODY:
                        yield protocol.refused(413, f"request body over {MAX_BODY} bytes", "body_too_large")
                        return
                    if not req.request_body.end_of_stream:
                        if not streamed_request:
                            yield protocol.carry_on(kind)  # BUFFERED_PARTIAL: the rest follows
                        continue
                    try:
                        ticket = self.picker.pick(bytes(body), subset, self.destination_port)
                    except RouterError as e:
                        retry = e.headers.get("Retry-After")
                        yield protocol.refused(e.status, e.message, e.code or "", int(retry) if retry else None)
                        return
                    prefill = host_port(ticket.prefill.url) if ticket.prefill is not None else ""
                    destination = host_port(ticket.decode.url, self.destination_port)
                    if not streamed_request:
                        yield protocol.picked(destination, prefill)
                        continue
                    yield protocol.picked(destination, prefill, on_headers=True)
                    for part in protocol.streamed_body("request_body", bytes(body)):
                        yield part
                elif kind == "response_headers":
                    if ticket is not None:
                        ticket.prefill_done()  # the destination answers: the prompt is computed
                    yield protocol.carry_on(kind)
                elif kind == "response_body":
                    end = req.response_body.end_of_stream
                    if streamed_response:
                        for part in protocol.streamed_body("response_body", req.response_body.body, end):
                            yield part
                    else:
                        yield protocol.carry_on(kind)
                    if end and ticket is not None:
                        ticket.close()
                elif kind in ("request_trailers", "response_trailers"):
                    yield protocol.carry_on(kind)
        finally:
            if ticket is not None:
                ticket.close()  # the stream ended (the request is over, or the gateway gave up): release it


HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


async def serve(picker: Picker, host: str, port: int, destination_port: int = 0) -> grpc.aio.Server:
    """Start the gRPC server on ``host:port`` (0: a free port, read back from ``server.port``); ``destination_port``:
    the port the destination names on the decode worker's host (its routing sidecar; 0: the worker's own). It also
    serves gRPC's health checking protocol for the services the extension's protocol names (:data:`HEALTH_SERVICES`),
    all SERVING: pickers run active-active (no leader, no follower that must not take traffic), and a started
    picker has followed its workers' events from their first replay."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker, destination_port), server)
    health = grpc_health.aio.HealthServicer()
    for name in HEALTH_SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    server.port = bound  # type: ignore[attr-defined]
    log.info("endpoint picker (Envoy ext-proc) on %s:%d", host, bound)
    return server
