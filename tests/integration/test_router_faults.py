"""Faults on a real 1P2D stack (vLLM workers with the pdserve connector, the router in front; the shared ``pd_faults``
launch, whose P/D exactness and KV integrity modules ran first), in order on one stack: a stopped (slow) prefill worker is waited for, not ejected; a decode worker SIGKILLed mid-stream, whose
request goes on elsewhere with the same greedy output, token for token; P SIGKILLed after its first token and
before D read the KV (D recomputes, the client sees nothing); then the last decode worker serves whole requests
alone and /ready says "degraded"."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import threading
import time
import urllib.request

import pytest

from pdserve.bench.prom import scrape
from pdserve.launch import Cluster
from pdserve.prom import label_values

from .otlp_collector import tree

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def cluster(pd_faults):
    return pd_faults  # tests/integration/conftest.py: the shared 1P2D launch (served as "m"), whose other modules ran first


def _child(cluster: Cluster, role: str, i: int = 0):
    return [c for c in cluster.workers if c.name.rstrip("0123456789") == role][i]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _body(seed: int, max_tokens: int, **kw) -> dict:
    ids = [random.Random(seed).randrange(1000, 40000) for _ in range(40)]
    return {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


def _stream_events(url: str, body: dict, on_event=None, headers: dict | None = None) -> list[dict]:
    """POST a streamed completion; every SSE event's JSON, in order (``on_event(n)`` after the n-th)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    events: list[dict] = []
    with urllib.request.urlopen(req, timeout=180) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if on_event is not None:
                on_event(len(events))
    return events


def _text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def test_stopped_prefill_worker_is_waited_for_not_ejected(cluster):
    p = _child(cluster, "prefill")
    body = _body(1, 8)
    reference = _post(cluster.worker_urls("decode")[0] + "/v1/completions", body)["choices"][0]["text"]
    out: dict = {}

    # n=2 with prompt_logprobs: every choice waits on P too (temperature 1e-5: vLLM refuses greedy n > 1)
    scored = {**body, "n": 2, "prompt_logprobs": 1, "temperature": 1e-5}

    def client() -> None:
        out["answer"] = _post(cluster.router_url + "/v1/completions", body)

    def client_n2() -> None:
        out["n2"] = _post(cluster.router_url + "/v1/completions", scored)

    os.kill(p.pid, signal.SIGSTOP)  # its HTTP server stops answering; the process is alive
    try:
        t0 = time.monotonic()
        th = threading.Thread(target=client)
        th.start()
        th2 = threading.Thread(target=client_n2)
        th2.start()
        time.sleep(3.0)  # ~6 background probes of P time out meanwhile (0.5 s each, every 0.5 s)
        st, workers = _get(cluster.router_url + "/v1/pdserve/workers")
        assert st == 200
        assert all(w["healthy"] for w in workers["workers"]), workers  # slow is not dead
        assert _get(cluster.router_url + "/ready")[1]["status"] == "ready"
    finally:
        os.kill(p.pid, signal.SIGCONT)
    th.join(120)
    th2.join(120)
    assert out["answer"]["choices"][0]["text"] == reference
    assert [c["text"] for c in out["n2"]["choices"]] == [reference, reference]
    assert all(len(c["prompt_logprobs"]) == 40 for c in out["n2"]["choices"])
    assert time.monotonic() - t0 >= 3.0
    assert sum(scrape(cluster.router_url, "pdserve_router_migrations_total").values()) == 0  # waited, not moved


def _decoding_on(cluster: Cluster) -> int:
    """Which decode worker runs the one request in flight: from the router's own record of where it placed it
    (the conductor's per-worker ``pdserve_worker_running_requests`` on the router's /metrics, set at placement), not
    from vLLM's running-requests gauge, which lags behind the stream."""
    running = scrape(cluster.router_url, "pdserve_worker_running_requests", labels=True)
    urls = cluster.worker_urls("decode")
    on = [i for i, url in enumerate(urls)
          if any(label_values(k).get("worker") == url and v >= 1 for k, v in running.items())]
    assert len(on) == 1, running
    return on[0]


KILLED: dict[str, int] = {}  # which decode worker the mid-stream kill took


MIGRATED_TRACE = "5a0e7f6c3b2d41e8a9c0d1e2f3a4b5c6"  # the client's trace id of the migrated request


def test_decode_killed_mid_stream_request_migrates_with_exact_output(cluster, otlp_collector):
    body = _body(2, 200)
    reference = _post(cluster.worker_urls("decode")[0] + "/v1/completions", body)["choices"][0]["text"]

    def kill_after(n: int) -> None:
        if n == 4:  # the decode worker streaming this request
            i = _decoding_on(cluster)
            KILLED["decode"] = i
            os.killpg(_child(cluster, "decode", i).pgid, signal.SIGKILL)

    events = _stream_events(cluster.router_url, {**body, "stream_options": {"include_usage": True}}, kill_after,
                            {"traceparent": f"00-{MIGRATED_TRACE}-00f067aa0ba902b7-01"})
    assert not any("error" in e for e in events), events[-2:]
    assert _child(cluster, "decode", KILLED["decode"]).proc.wait(10) is not None
    assert _text(events) == reference  # no token lost or repeated, same greedy output
    assert events[-1]["usage"]["completion_tokens"] == 200
    migrated = scrape(cluster.router_url, "pdserve_router_migrations_total")
    assert sum(migrated.values()) == 1, migrated
    # its trace (the stack is traced: tests/integration/conftest.py): the killed D's attempt ends in "migrate", the
    # request is placed again and a continued attempt streams the rest, with vLLM's span of the worker that did
    spans = otlp_collector.wait_for(MIGRATED_TRACE, lambda got: any(
        s["name"] == "POST /v1/completions" for s in got) and any(s["name"] == "llm_request" for s in got))
    print(tree(spans))
    attempts = [s for s in spans if "attempt" in s["name"]]
    dead = cluster.worker_urls("decode")[KILLED["decode"]]
    failed = [s for s in attempts if s["attributes"]["pdserve.worker.url"] == dead]
    assert [s["attributes"]["pdserve.attempt.outcome"] for s in failed] == ["migrate"], tree(spans)
    continued = [s for s in attempts if s["attributes"]["pdserve.placement.tokens_before"] > 0]
    assert continued and all(s["attributes"]["pdserve.worker.url"] != dead for s in continued), tree(spans)
    assert sum(s["name"] == "placement" for s in spans) >= 2
    under = {s["parent_span_id"] for s in spans if s["name"] == "llm_request"}
    assert under & {s["span_id"] for s in continued}, tree(spans)


def test_prefill_killed_before_decode_read_its_kv_decode_recomputes(cluster):
    d = _child(cluster, "decode", 1 - KILLED["decode"])
    p = _child(cluster, "prefill")
    body = _body(4, 24)
    reference = _post(d.url + "/v1/completions", body)["choices"][0]["text"]
    failures = scrape(d.url, "vllm:pdserve_kv_read_failures_total").get("vllm:pdserve_kv_read_failures_total", 0.0)
    first = threading.Event()
    out: dict = {}

    def client() -> None:
        out["events"] = _stream_events(cluster.router_url, body, lambda n: first.set())

    deadline = time.monotonic() + 30  # the router has seen decode KILLED go: every decode goes to d
    while _get(cluster.router_url + "/ready")[1].get("healthy_workers") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(d.pid, signal.SIGSTOP)  # D's HTTP server holds the decode until P is gone
    try:
        th = threading.Thread(target=client)
        th.start()
        assert first.wait(60), "P's first token never came"
        os.killpg(p.pgid, signal.SIGKILL)
        p.proc.wait(10)
    finally:
        os.kill(d.pid, signal.SIGCONT)
    th.join(120)
    assert not any("error" in e for e in out["events"]), out["events"][-2:]
    assert _text(out["events"]) == reference
    after = scrape(d.url, "vllm:pdserve_kv_read_failures_total").get("vllm:pdserve_kv_read_failures_total", 0.0)
    # D's early read from the dead P failed (its question went unanswered) and D computed the prompt itself; greedy
    # from a P that sends layer by layer, D regenerates t1 (--early-continue auto), equal to P's, so no serial
    # hand-off follows (with continuation D would have no t1 to continue after: a second, serial, failed read)
    assert after == failures + 1
    assert sum(scrape(cluster.router_url, "pdserve_router_migrations_total").values()) == 1  # no move needed


def test_decode_worker_serves_alone_while_prefill_is_gone(cluster):
    d = _child(cluster, "decode", 1 - KILLED["decode"])
    deadline = time.monotonic() + 30
    while (ready := _get(cluster.router_url + "/ready"))[1].get("status") != "degraded" \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready == (200, {"status": "degraded", "mode": "disaggregated", "healthy_workers": 1, "workers": 3,
                           "missing": ["prefill"]})
    body = _body(3, 12)
    reference = _post(d.url + "/v1/completions", body)["choices"][0]["text"]
    assert _post(cluster.router_url + "/v1/completions", body)["choices"][0]["text"] == reference
    assert _text(_stream_events(cluster.router_url, body)) == reference
