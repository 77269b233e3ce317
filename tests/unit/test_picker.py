"""The endpoint picker over gRPC, driven by a client built from Envoy's published ext-proc definitions (the
``xds-protos`` stubs), sending what a gateway sends in BUFFERED body mode: headers, then the body. It answers
with the chosen endpoint as the header and the ``envoy.lb`` metadata (decode worker as the destination, the
prefill worker in ``x-prefiller-host-port``), follows the prefix index, releases the placement when the stream
ends, and answers what it cannot place with an immediate OpenAI-style error (400, 429 + retry-after, 503)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from pdserve.hashing import block_hashes
from pdserve.picker import protocol
from pdserve.picker.picker import Picker
from pdserve.picker.server import serve
from pdserve.router.config import RouterConfig
from tests.unit.test_router_app import model_dir, tokenizer  # noqa: F401  (fixtures)

P0, P1, D0 = "http://127.0.0.1:18001", "http://127.0.0.1:18002", "http://127.0.0.1:18003"
BS = 4


def _headers(end: bool = False) -> pb.ProcessingRequest:
    hs = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json")]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
        end_of_stream=end))


def _body(raw: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


async def _exchange(stub: Any, *msgs: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    async def gen():
        for m in msgs:
            yield m

    return [r async for r in stub.Process(gen())]


def _set(resp: pb.ProcessingResponse) -> dict[str, str]:
    common = resp.request_body.response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


@asynccontextmanager
async def _serving(picker: Picker, **serve_kw: Any) -> AsyncIterator[grpc.aio.Channel]:
    """``picker`` started and served over gRPC on a free port: a channel to it; stopped and closed afterwards."""
    await picker.start()
    server = await serve(picker, "127.0.0.1", 0, **serve_kw)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield ch
    finally:
        await server.stop(0)
        await picker.close()


def _picker(model_dir, tokenizer, **kw) -> Picker:  # noqa: F811
    kw.setdefault("health_interval_s", 0)  # nobody listens on the fake workers' ports: no probes but where asked
    cfg = RouterConfig(model_dir=str(model_dir), prefill=(P0, P1), decode=(D0,), block_size=BS,
                       local_prefill_tokens=0, calibrate=False, policy="conductor", **kw)
    return Picker(cfg, tokenizer)


def test_picks_the_prefix_holder_and_releases_it(model_dir, tokenizer):  # noqa: F811
    async def main() -> None:
        picker = _picker(model_dir, tokenizer)
        async with _serving(picker) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            prompt = list(range(5, 25))  # 5 blocks of 4
            picker.conductor.blocks_stored(P1, block_hashes(prompt, BS)[:4])
            body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 3}).encode()
            out = await _exchange(stub, _headers(), _body(body))
            assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
            assert _set(out[1]) == {protocol.DESTINATION: "127.0.0.1:18003", protocol.PREFILLER: "127.0.0.1:18002"}
            meta = out[1].dynamic_metadata.fields[protocol.METADATA_NAMESPACE].struct_value
            assert meta.fields[protocol.DESTINATION].string_value == "127.0.0.1:18003"
            assert out[1].request_body.response.clear_route_cache
            # text prompts are tokenized with the model's tokenizer; chat through its template
            for req in ({"prompt": "hello world", "max_tokens": 2},
                        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}):
                out = await _exchange(stub, _headers(), _body(json.dumps(req).encode()))
                assert _set(out[1])[protocol.DESTINATION] == "127.0.0.1:18003"
            await asyncio.sleep(0.05)
            assert picker.decisions == 3
            c = picker.conductor
            assert all(not w.prefills and not w.decodes for w in c.workers.values())  # every stream released

    asyncio.run(main())


def test_destination_port_names_the_decode_pods_sidecar(model_dir, tokenizer):  # noqa: F811
    """--destination-port: the destination is that port on D's host (the routing sidecar beside D, the
    InferencePool's target port); P stays the prefill worker's own address."""
    async def main() -> None:
        picker = _picker(model_dir, tokenizer)
        async with _serving(picker, destination_port=8200) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            body = json.dumps({"model": "m", "prompt": list(range(5, 25)), "max_tokens": 3}).encode()
            out = await _exchange(stub, _headers(), _body(body))
            got = _set(out[1])
            assert got[protocol.DESTINATION] == "127.0.0.1:8200" and got[protocol.PREFILLER] in (
                "127.0.0.1:18001", "127.0.0.1:18002")
            meta = out[1].dynamic_metadata.fields[protocol.METADATA_NAMESPACE].struct_value
            assert meta.fields[protocol.DESTINATION].string_value == "127.0.0.1:8200"

    asyncio.run(main())


def test_refusals_are_immediate_openai_errors(model_dir, tokenizer):  # noqa: F811
    async def main() -> None:
        picker = _picker(model_dir, tokenizer, ttft_slo_ms=1e-6)
        async with _serving(picker) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            cases = [(b"{not json", 400), (b'{"prompt": 5}', 400), (b'{"prompt": [1, 2], "max_tokens": 0}', 400),
                     (json.dumps({"prompt": list(range(5, 40))}).encode(), 429)]
            for raw, status in cases:
                out = await _exchange(stub, _headers(), _body(raw))
                imm = out[-1].immediate_response
                assert imm.status.code == status, (raw, imm)
                assert "message" in json.loads(imm.body)["error"]
                hs = {h.header.key for h in imm.headers.set_headers}
                assert ("retry-after" in hs) == (status == 429)
            out = await _exchange(stub, _headers(end=True))  # a request without a body
            assert out[-1].immediate_response.status.code == 400
            for w in (P0, P1, D0):
                picker.registry.set_health(w, False, "down")
            out = await _exchange(stub, _headers(), _body(b'{"prompt": [1, 2, 3]}'))
            assert out[-1].immediate_response.status.code == 503

    asyncio.run(main())


def test_a_worker_that_refuses_connections_is_no_longer_picked(model_dir, tokenizer):  # noqa: F811
    """The picker probes /health as the router does: nobody listens on the fake workers' ports, so each is out
    after its first probe and the gateway gets 503 instead of a dead endpoint."""
    async def main() -> None:
        picker = _picker(model_dir, tokenizer, health_interval_s=0.05)
        await picker.start()
        try:
            for _ in range(100):
                if not any(w.healthy for w in picker.registry):
                    break
                await asyncio.sleep(0.05)
            assert not any(w.healthy for w in picker.registry)
            try:
                picker.pick(b'{"prompt": [1, 2, 3]}')
            except Exception as e:
                assert getattr(e, "status", None) == 503
            else:
                raise AssertionError("a dead worker was picked")
        finally:
            await picker.close()

    asyncio.run(main())


def _streamed_config() -> pb.ProcessingRequest:
    """What Envoy sends first with both body modes FULL_DUPLEX_STREAMED (the extension's streaming mode): the
    modes in ``protocol_config``, beside the request headers."""
    first = _headers()
    first.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=protocol.STREAMED,
                                                            response_body_mode=protocol.STREAMED))
    return first


def test_full_duplex_streamed_body_mode(model_dir, tokenizer):  # noqa: F811
    """In FULL_DUPLEX_STREAMED the gateway forwards only what the picker sends back: nothing answers the headers
    or the body's chunks until the body ends; then the headers' answer carries the endpoint (header and metadata)
    and the body goes back unchanged in streamed chunks of at most 62 KiB, the last one ending the stream; the
    response body is echoed chunk by chunk, and its end releases the placement."""
    async def main() -> None:
        picker = _picker(model_dir, tokenizer)
        async with _serving(picker) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            prompt = list(range(5, 25))
            picker.conductor.blocks_stored(P1, block_hashes(prompt, BS)[:4])
            body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 3,
                               "user": "x" * 100_000}).encode()  # over one 62 KiB chunk
            cut = len(body) // 3
            chunks = [pb.ProcessingRequest(request_body=pb.HttpBody(body=body[a:b], end_of_stream=b == len(body)))
                      for a, b in ((0, cut), (cut, 2 * cut), (2 * cut, len(body)))]
            answer = [pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
                      pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n")),
                      pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))]
            out = await _exchange(stub, _streamed_config(), *chunks, *answer)
            kinds = [r.WhichOneof("response") for r in out]
            assert kinds == ["request_headers", "request_body", "request_body", "response_headers",
                             "response_body", "response_body"], kinds
            common = out[0].request_headers.response
            assert {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers} == \
                {protocol.DESTINATION: "127.0.0.1:18003", protocol.PREFILLER: "127.0.0.1:18002"}
            meta = out[0].dynamic_metadata.fields[protocol.METADATA_NAMESPACE].struct_value
            assert meta.fields[protocol.DESTINATION].string_value == "127.0.0.1:18003"
            sent = [r.request_body.response.body_mutation.streamed_response for r in out[1:3]]
            assert b"".join(s.body for s in sent) == body and all(len(s.body) <= protocol.CHUNK for s in sent)
            assert [s.end_of_stream for s in sent] == [False, True]
            echoed = [r.response_body.response.body_mutation.streamed_response for r in out[4:]]
            assert [(e.body, e.end_of_stream) for e in echoed] == [(b"data: 1\n\n", False),
                                                                  (b"data: [DONE]\n\n", True)]
            # a refusal is still an immediate response, whatever the mode
            out = await _exchange(stub, _streamed_config(), _body(b"{not json"))
            assert [r.WhichOneof("response") for r in out] == ["immediate_response"]
            assert out[0].immediate_response.status.code == 400
            await asyncio.sleep(0.05)
            assert all(not w.prefills and not w.decodes for w in picker.conductor.workers.values())

    asyncio.run(main())


def test_grpc_health_for_the_services_the_protocol_names(model_dir, tokenizer):  # noqa: F811
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.picker.server import HEALTH_SERVICES

    async def main() -> None:
        picker = _picker(model_dir, tokenizer)
        async with _serving(picker) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in HEALTH_SERVICES:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert r.status == health_pb2.HealthCheckResponse.SERVING, name
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


def test_the_gateway_s_endpoint_subset_is_honoured(model_dir, tokenizer):  # noqa: F811
    """The extension's subset hint (``envoy.lb.subset_hint`` in the request's filter metadata): the destination is
    one of the listed endpoints (a listed prefill worker serves whole, as when no decode worker is up); when none of
    them is a worker, the answer is an immediate 503."""
    from google.protobuf import struct_pb2

    def hinted(endpoints: list[str]) -> pb.ProcessingRequest:
        first = _headers()
        hint = struct_pb2.Struct()
        hint.update({protocol.SUBSET: endpoints})
        first.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].CopyFrom(hint)
        return first

    async def main() -> None:
        picker = _picker(model_dir, tokenizer)
        async with _serving(picker) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            body = _body(json.dumps({"model": "m", "prompt": list(range(5, 25)), "max_tokens": 3}).encode())
            out = await _exchange(stub, hinted(["10.1.1.1:8000", "127.0.0.1:18003"]), body)
            assert _set(out[1])[protocol.DESTINATION] == "127.0.0.1:18003"
            # only a prefill worker listed: it serves the request whole (as when no decode worker is up)
            out = await _exchange(stub, hinted(["127.0.0.1:18001"]), body)
            assert _set(out[1])[protocol.DESTINATION] == "127.0.0.1:18001"
            for endpoints in (["10.1.1.1:8000"], []):  # no worker of the pool; none at all
                out = await _exchange(stub, hinted(endpoints), body)
                assert [r.WhichOneof("response") for r in out] == ["request_headers", "immediate_response"]
                assert out[1].immediate_response.status.code == 503, endpoints
            await asyncio.sleep(0.05)
            assert all(not w.prefills and not w.decodes for w in picker.conductor.workers.values())

    asyncio.run(main())
