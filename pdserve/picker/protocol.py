"""The endpoint-picker side of Envoy's ext-proc protocol, as the Gateway API Inference Extension uses it.

The gateway opens one ``Process`` stream per HTTP request and sends the request's headers, then its body. In body
mode ``BUFFERED`` (or ``BUFFERED_PARTIAL``) the picker answers the headers with a plain continue and the body with
the chosen endpoint: the header ``x-gateway-destination-endpoint: HOST:PORT`` and the same key in the dynamic
metadata namespace ``envoy.lb`` (what the extension's protocol names for the gateway's original-destination
cluster). In ``FULL_DUPLEX_STREAMED`` (the mode the extension's protocol requires an endpoint picker to support;
Envoy names the modes in the stream's first message, ``protocol_config``) the gateway forwards nothing the picker
has not sent back: the picker gathers the body's chunks, then answers the headers with the chosen endpoint and
sends the body back unchanged as streamed body responses; a streamed response body is echoed chunk by chunk.
For a P -> D placement the decode worker is the destination (it streams the answer) and the prefill worker goes
in ``x-prefiller-host-port`` (llm-d's header, which its decode sidecar reads). A request the picker cannot place
gets an immediate response: 400 for a body it cannot read, 429 with ``retry-after`` when the conductor rejects
it, 503 when no worker can take it, each with an OpenAI-style JSON error. Response headers and body pass through
unchanged (a response's end releases the placement).
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
PREFILLER = "x-prefiller-host-port"  # llm-d's P -> D header
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # the gateway's allowed endpoints for a request, in its filter metadata
SUBSET = "x-gateway-destination-endpoint-subset"
STREAMED = mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
CHUNK = 62 * 1024  # a streamed body goes back in chunks of at most this many bytes (below gRPC's message limits)


def headers_of(msg: pb.HttpHeaders) -> dict[str, str]:
    """An ext-proc header map as a dict (lower-case keys; ``raw_value`` when the gateway sends bytes)."""
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in msg.headers.headers}


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))


def carry_on(kind: str) -> pb.ProcessingResponse:
    """Continue unchanged: the answer to headers, trailers or a body the picker does not act on."""
    if kind in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
    if kind in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{kind: pb.BodyResponse()})
    return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})


def picked(destination: str, prefiller: str = "", on_headers: bool = False) -> pb.ProcessingResponse:
    """Route to ``destination`` (HOST:PORT): the header, and the ``envoy.lb`` metadata the gateway reads."""
    sets = [_header(DESTINATION, destination)] + ([_header(PREFILLER, prefiller)] if prefiller else [])
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets), clear_route_cache=True)
    meta = struct_pb2.Struct()
    meta.update({METADATA_NAMESPACE: {DESTINATION: destination}})
    if on_headers:
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=meta)


def refused(status: int, message: str, code: str | int, retry_after_s: int | None = None) -> pb.ProcessingResponse:
    """An immediate response to the client: OpenAI's error object with ``status``."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status == 400 else
                                 "server_error", "param": None, "code": code}}).encode()
    sets = [_header("content-type", "application/json")]
    if retry_after_s is not None:
        sets.append(_header("retry-after", str(retry_after_s)))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=sets), body=body,
        details=code))


def streamed_body(kind: str, body: bytes, end: bool = True) -> list[pb.ProcessingResponse]:
    """``body`` sent back to the gateway as ``kind`` (``request_body`` / ``response_body``) streamed body responses
    (FULL_DUPLEX_STREAMED), in chunks of at most :data:`CHUNK` bytes, the last one marked ``end``."""
    parts = [body[i:i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    return [pb.ProcessingResponse(**{kind: pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=part, end_of_stream=end and i == len(parts) - 1))))})
        for i, part in enumerate(parts)]


def subset_of(req: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints (``HOST:PORT``) the gateway lets the picker choose from for this request (the extension's
    subset hint in ``metadata_context``), or None when it names none (every endpoint of the pool)."""
    hint = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]
