"""P SIGKILLed under 8 concurrent greedy streams on 1P1D (fp32, the pool on, as `pdserve serve` starts it): every
in-flight request completes, and each one's output equals the decode worker's alone, token for token (issue 23).
Which requests are on P when it dies comes from the router's own record, not from timing."""

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

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(600),
]  # shares pd_cluster (tests/conftest.py: SHARED_STACKS)

CLIENTS = 8


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as resp:
        return json.loads(resp.read())


BODY = {"model": "rl", "prompt": [random.Random(7).randrange(1000, 40000) for _ in range(300)], "max_tokens": 64,
        "temperature": 0, "ignore_eos": True}


def _stream(url: str, on_event) -> tuple[int, list[dict]]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**BODY, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events: list[dict] = []
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                on_event(len(events))
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(e.read())]
    return 200, events


def _queued_on(cluster: Cluster, url: str) -> float:
    """Prompt tokens the router placed on ``url`` and has not seen prefilled (its own record, not vLLM's)."""
    queued = scrape(cluster.router_url, "pdserve_worker_queued_prefill_tokens", labels=True)
    return sum(v for k, v in queued.items() if label_values(k).get("worker") == url)


def test_prefill_killed_under_concurrent_streams_every_request_completes_exactly(cluster):
    """Six streams decode on D, two more wait on P (stopped), then P is SIGKILLed: the two migrate (whole on D),
    the six go on, every output equals D's alone, token for token. With early dispatch the two wait on D as well,
    for P's blocks: D's wait ends with P, and D holds no block and no request afterwards."""
    reference = _post(cluster.worker_urls("decode")[0] + "/v1/completions", BODY)["choices"][0]["text"]
    # the shared stack's earlier tests may have migrated requests too: this test counts its own
    before = scrape(cluster.router_url, "pdserve_router_migrations_total", labels=True)
    p = next(c for c in cluster.workers if c.name.startswith("prefill"))
    started = [threading.Event() for _ in range(CLIENTS)]
    results: dict[int, tuple[int, list[dict]]] = {}

    def client(i: int) -> None:  # "started": a token from D (the first is P's, streamed while D may still read P)
        results[i] = _stream(cluster.router_url, lambda n: n >= 2 and started[i].set())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for th in threads[:6]:
        th.start()
    assert all(e.wait(120) for e in started[:6]), "the first six never streamed from D"
    os.kill(p.pid, signal.SIGSTOP)  # P holds the next two prompts
    try:
        for th in threads[6:]:
            th.start()
        deadline = time.monotonic() + 60
        while _queued_on(cluster, p.url) < 2 * len(BODY["prompt"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _queued_on(cluster, p.url) >= 2 * len(BODY["prompt"]), "the two never reached P"
    finally:
        os.killpg(p.pgid, signal.SIGKILL)
    p.proc.wait(10)
    for th in threads:
        th.join(300)
    log = (cluster.run_dir / "router.log").read_text() if cluster.run_dir else ""
    for i in range(CLIENTS):
        status, events = results[i]
        assert status == 200 and not any("error" in e for e in events), (i, status, events[-2:], log[-6000:])
        assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == reference, (i, log[-6000:])
    after = scrape(cluster.router_url, "pdserve_router_migrations_total", labels=True)
    migrated = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert migrated == {'pdserve_router_migrations_total{role="prefill"}': 2.0}, (migrated, log[-6000:])
    # early dispatch (issue 37): the two were on D too, waiting for P's prefill when P died; D's waits ended (P's
    # engine gone: the read failed), their requests were aborted and every block on D is free again
    early = scrape(cluster.router_url, "pdserve_router_handoffs_total", labels=True)
    # (the first six may have gone the serial way on a fresh stack, before the router knew P's engine; the two P
    # held were sent after P had answered them)
    assert early.get('pdserve_router_handoffs_total{outcome="early"}', 0.0) >= 2, early
    d_url = cluster.worker_urls("decode")[0]
    deadline = time.monotonic() + 30  # inside a lease and far inside D's 60 s wait: the wait ended on P's death

    def held() -> tuple[float, float, float]:
        m = scrape(d_url, "vllm:")
        return (m.get("vllm:kv_cache_usage_perc", 0.0), m.get("vllm:num_requests_waiting", 0.0),
                m.get("vllm:num_requests_running", 0.0))

    while held() != (0.0, 0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.2)
    d_log = (cluster.run_dir / "decode0.log").read_text()[-6000:] if cluster.run_dir else ""
    assert held() == (0.0, 0.0, 0.0), (held(), d_log)
