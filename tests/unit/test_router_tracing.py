"""The router's OpenTelemetry traces (router/tracing/) on fake workers, spans caught by the SDK's in-memory
exporter: one request's tree (the request, admission, placement with its decision, P's and D's attempts, the
relay), the traceparent each worker gets, a migrated request's second attempt, and tracing off (no span, no
header)."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdserve.router.app import ROUTER_KEY
from pdserve.router.tracing import exporter as exporter_mod
from pdserve.router.tracing.parts import DECISION_EVENT
from pdserve.router.tracing.request import RECORD_EVENT
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def spans(monkeypatch) -> InMemorySpanExporter:
    mem = InMemorySpanExporter()
    monkeypatch.setattr(exporter_mod, "span_exporter", lambda endpoint: mem)
    return mem


def _flush(env: Env) -> None:
    env.app[ROUTER_KEY].tracing.provider.force_flush()


def _parent_of(traceparent: str) -> tuple[str, str]:
    _, trace_id, span_id, _ = traceparent.split("-")
    return trace_id, span_id


def test_a_pd_request_is_one_tree_and_p_and_d_get_its_traceparent(model_dir, tokenizer, spans):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], otlp_traces_endpoint="http://127.0.0.1:1") as env:
            st, events = await env.stream("/v1/completions", {"prompt": "the cat sat", "max_tokens": 6,
                                                              "stream": True, "ignore_eos": True},
                                          headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            assert st == 200, events
            rid = json.loads(events[0])["id"]
            _flush(env)
            return rid

    rid = run(main())
    got = {s.name: s for s in spans.get_finished_spans()}
    assert {"POST /v1/completions", "admission", "placement", "prefill attempt", "decode attempt",
            "relay"} <= set(got), sorted(got)
    root = got["POST /v1/completions"]
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert all(s.context.trace_id == root.context.trace_id for s in got.values())
    for name in ("admission", "placement", "prefill attempt", "decode attempt"):
        assert got[name].parent.span_id == root.context.span_id, name
    assert got["relay"].parent.span_id == got["decode attempt"].context.span_id
    assert got["relay"].attributes["pdserve.relay.tokens"] > 0
    placed = got["placement"].attributes
    assert placed["pdserve.decision.kind"] == "disaggregated"
    assert (placed["pdserve.decision.prefill"], placed["pdserve.decision.decode"]) == (p.url, d.url)
    assert placed["pdserve.decision.predicted_ttft_s"] > 0 and placed["pdserve.decision.rule"]
    assert [e.name for e in got["placement"].events] == [DECISION_EVENT]
    assert root.attributes["pdserve.request_id"] == rid and root.attributes["http.response.status_code"] == 200
    (record,) = [e for e in root.events if e.name == RECORD_EVENT]
    rec = json.loads(record.attributes["record"])
    assert rec["request_id"] == rid and rec["placements"][0]["measured"]["ttft_s"] > 0
    # each worker's call names its attempt's span: vLLM's own spans join the trace under it
    for worker, name in ((p, "prefill attempt"), (d, "decode attempt")):
        (h,) = worker.headers
        assert _parent_of(h["traceparent"]) == (CLIENT_TRACE, f"{got[name].context.span_id:016x}")
        assert got[name].attributes["pdserve.attempt.outcome"] == "ok"


def test_a_migrated_request_has_its_continued_attempt_in_the_same_trace(model_dir, tokenizer, spans):
    p, d1, d2 = FakeWorker("P"), FakeWorker("D1", die_after=2), FakeWorker("D2", die_after=2)

    async def main():
        async with Env(model_dir, tokenizer, [p], [d1, d2], otlp_traces_endpoint="http://127.0.0.1:1") as env:
            st, out = await env.post("/v1/completions", {"prompt": "the cat sat", "max_tokens": 5,
                                                         "ignore_eos": True})
            assert st == 200, out
            _flush(env)

    run(main())
    got = spans.get_finished_spans()
    (root,) = [s for s in got if s.name == "POST /v1/completions"]
    attempts = sorted((s for s in got if "attempt" in s.name), key=lambda s: s.start_time)
    assert all(s.context.trace_id == root.context.trace_id for s in got)
    failed = [s for s in attempts if s.attributes["pdserve.attempt.outcome"] == "migrate"]
    assert failed and failed[0].status.status_code == StatusCode.ERROR
    continued = [s for s in attempts if s.name.endswith("(continued)")]
    assert continued and continued[0].attributes["pdserve.placement.tokens_before"] > 0
    assert len([s for s in got if s.name == "placement"]) >= 2  # the migration's own placement
    rec = json.loads([e for e in root.events if e.name == RECORD_EVENT][0].attributes["record"])
    assert [pl["why"] for pl in rec["placements"]][:2] == ["first", "migration"]


def test_tracing_off_makes_no_span_and_sends_no_traceparent(model_dir, tokenizer, spans):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            assert env.app[ROUTER_KEY].tracing is None
            st, out = await env.post("/v1/completions", {"prompt": "the cat sat", "max_tokens": 3},
                                     headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            assert st == 200, out

    run(main())
    assert spans.get_finished_spans() == ()
    assert all("traceparent" not in h for w in (p, d) for h in w.headers)


def test_a_move_is_a_span_of_the_moved_request_linked_to_the_placement_that_caused_it(monkeypatch):
    import time
    from types import SimpleNamespace

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from pdserve.router.tracing import parts
    from pdserve.router.tracing.parts import MOVE_EVENT, TracedPlacement, move_span
    from pdserve.router.tracing.request import RequestTrace

    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    tracer = provider.get_tracer("test")
    url = lambda u: SimpleNamespace(url=u)  # noqa: E731
    moved = SimpleNamespace(request_id="m1", prefill=url("http://w0"), decode=url("http://w1"), cause=None,
                            caused_by="r1", decision=SimpleNamespace(reason="decode stalled by a long prefill"))
    causing = RequestTrace(tracer, tracer.start_span("POST /v1/completions"))  # the request whose prefill moves it
    inner = SimpleNamespace(registry=None, choose=lambda *a, **k: SimpleNamespace(decision=None, waits=(moved,)))
    TracedPlacement(inner, causing).choose([1, 2, 3], request_id="r1")  # type: ignore[arg-type]
    (placement,) = [s for s in mem.get_finished_spans() if s.name == "placement"]
    assert moved.cause == placement.context
    (event,) = [e for e in placement.events if e.name == MOVE_EVENT]
    assert dict(event.attributes) == {"pdserve.move.request_id": "m1", "pdserve.move.from": "http://w0",
                                      "pdserve.move.to": "http://w1"}
    mine = RequestTrace(tracer, tracer.start_span("POST /v1/completions"))  # the moved request's own trace
    monkeypatch.setattr(parts, "current", lambda: mine)
    move_span(moved, time.perf_counter() - 0.05)  # type: ignore[arg-type]
    (move,) = [s for s in mem.get_finished_spans() if s.name == "move"]
    assert move.context.trace_id == mine.root.context.trace_id and move.parent.span_id == mine.root.context.span_id
    assert [link.context for link in move.links] == [placement.context]  # -> the causing request's placement
    assert move.attributes["pdserve.move.caused_by"] == "r1" and move.attributes["pdserve.move.to"] == "http://w1"
    assert 0.04e9 < move.end_time - move.start_time < 5e9  # from the stop on the old worker
    monkeypatch.setattr(parts, "current", lambda: None)
    move_span(moved, None)  # type: ignore[arg-type]  # the moved request untraced: nothing
    assert len([s for s in mem.get_finished_spans() if s.name == "move"]) == 1
