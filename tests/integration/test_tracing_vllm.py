"""One request's trace through a real 1P2D stack (the shared ``pd_faults`` launch, traced: the router and every vLLM
worker export to a real OTLP/gRPC collector in its own process, tests/integration/otlp_collector.py): the router's
spans (the request, joined to the client's traceparent; admission; placement; P's and D's attempts; the relay),
vLLM's own ``llm_request`` span of P and of D, each under the attempt that called it, the connector's KV read in D
and P's lease of the blocks it read (pdserve/vllm/spans.py), as one tree. The output with
tracing on is the decode worker's own, token for token. test_router_faults.py checks a migrated request's trace."""

from __future__ import annotations

import importlib.util
import json
import random
import urllib.request

import pytest

from .otlp_collector import tree

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(300),
]

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[dict, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(resp.headers), resp.read()


def _sse_text(raw: bytes) -> str:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out += [c.get("text", "") for c in json.loads(line[6:]).get("choices", [])]
    return "".join(out)


def test_a_streamed_pd_request_is_one_trace_across_router_p_and_d(pd_faults, otlp_collector):
    ids = [random.Random(40).randrange(1000, 30000) for _ in range(150)]  # over one 128-token block: KV moves
    body = {"model": "m", "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, ref = _post(pd_faults.worker_urls("decode")[0] + "/v1/completions", body)
    _, raw = _post(pd_faults.router_url + "/v1/completions", {**body, "stream": True},
                   {"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"})
    assert _sse_text(raw) == json.loads(ref)["choices"][0]["text"]  # tracing on: the same greedy output

    def complete(spans: list[dict]) -> bool:
        names = {(s["service"], s["name"]) for s in spans}
        return ("pdserve-router", "POST /v1/completions") in names and \
            sum(s["name"] == "llm_request" for s in spans) == 2 and \
            all(any(s["name"] == n for s in spans) for n in ("pdserve.kv_read", "pdserve.kv_lease"))
    spans = otlp_collector.wait_for(TRACE, complete)
    print(tree(spans))  # the report's picture of one request
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    (root,) = by_name["POST /v1/completions"]
    assert root["parent_span_id"] == CLIENT_SPAN and root["attributes"]["http.response.status_code"] == 200
    for name in ("admission", "placement", "prefill attempt", "decode attempt"):
        (s,) = by_name[name]
        assert s["service"] == "pdserve-router" and s["parent_span_id"] == root["span_id"], name
    (prefill,), (decode,) = by_name["prefill attempt"], by_name["decode attempt"]
    assert prefill["attributes"]["pdserve.worker.url"] == pd_faults.worker_urls("prefill")[0]
    assert decode["attributes"]["pdserve.worker.url"] in pd_faults.worker_urls("decode")
    assert by_name["relay"] and all(r["parent_span_id"] == decode["span_id"] for r in by_name["relay"])
    placed = by_name["placement"][0]["attributes"]
    assert placed["pdserve.decision.prefill"] == prefill["attributes"]["pdserve.worker.url"]
    assert placed["pdserve.decision.decode"] == decode["attributes"]["pdserve.worker.url"]
    # vLLM's own span of each worker, under the attempt that called it, in the worker's service
    vllm = {s["parent_span_id"]: s for s in by_name["llm_request"]}
    assert set(vllm) == {prefill["span_id"], decode["span_id"]}
    assert vllm[prefill["span_id"]]["service"] == "pdserve-prefill0"
    assert vllm[prefill["span_id"]]["attributes"]["gen_ai.usage.completion_tokens"] == 1
    assert vllm[decode["span_id"]]["service"].startswith("pdserve-decode")
    assert vllm[decode["span_id"]]["attributes"]["gen_ai.usage.completion_tokens"] == 11
    # the connector's read of P's blocks in D (pdserve/vllm/spans.py), beside vLLM's span
    (read,) = by_name["pdserve.kv_read"]
    assert read["parent_span_id"] == decode["span_id"] and read["service"].startswith("pdserve-decode")
    assert read["attributes"]["pdserve.kv.ok"] is True and read["attributes"]["pdserve.kv.bytes"] > 0
    assert read["attributes"]["pdserve.kv.blocks"] == 1  # 150 prompt tokens: one full 128-token block
    # P's side of the hand-off: its lease of the blocks, from P's answer to D's notification, under P's attempt
    (lease,) = by_name["pdserve.kv_lease"]
    assert lease["parent_span_id"] == prefill["span_id"] and lease["service"] == "pdserve-prefill0"
    assert lease["attributes"]["pdserve.kv.released"] == "notified"
    record = [e for e in root["events"] if e["name"] == "pdserve.decision_record"]
    assert record and json.loads(record[0]["attributes"]["record"])["placements"][0]["why"] == "first"
