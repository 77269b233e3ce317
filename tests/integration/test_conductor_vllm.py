"""The conductor with real vLLM workers (2 prefill, 1 decode) behind two router replicas on one port: the workers'
KV events reach every replica's prefix index, and a repeated long prefix goes to the prefill worker that holds it
(whichever replica the kernel hands the request to), which then computes only the new tokens (its vLLM
prefix-cache hit counter shows it). Greedy output still equals one worker serving alone. The replicas' shared
membership and a replica's kill -9 are in tests/integration/router_replicas.py."""

from __future__ import annotations

import importlib.util
import json
import random
import time
import urllib.request

import pytest

from pdserve.bench.prom import scrape

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def _counter(url: str, name: str) -> float:
    return scrape(url, name).get(name, 0.0)


def _indexed(router: str) -> dict[str, int]:
    body = json.loads(_get(router + "/v1/pdserve/workers"))
    return {w["url"]: w.get("indexed_blocks", 0) for w in body["workers"]}


@pytest.fixture(scope="module")
def cluster(pd_conductor):
    return pd_conductor  # tests/integration/conftest.py: 2P1D, two router replicas, the pool, one LoRA adapter


def test_repeated_prefix_goes_to_its_holder(cluster):
    router = cluster.router_url
    rng = random.Random(7)
    prefix = [rng.randrange(1000, 30000) for _ in range(1400)]  # 10 full blocks of 128
    first = _post(router + "/v1/completions", {"model": "rl", "prompt": prefix + [5, 6, 7], "max_tokens": 4,
                                               "temperature": 0, "pdserve_timings": True})
    holder = first["pdserve_timings"]["prefill_worker"]
    other = next(u for u in cluster.worker_urls("prefill") if u != holder)
    deadline = time.monotonic() + 30
    while _indexed(router).get(holder, 0) < 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _indexed(router)[holder] >= 10, "the holder's KV events did not reach the router's index"

    hits_before = _counter(holder, "vllm:prefix_cache_hits_total")
    other_queries = _counter(other, "vllm:prefix_cache_queries_total")
    for i in range(3):
        body = {"model": "rl", "prompt": prefix + [100 + i] * 20, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "pdserve_timings": True}
        out = _post(router + "/v1/completions", body)
        assert out["pdserve_timings"]["prefill_worker"] == holder
        if i == 0:  # placement by prefix keeps disaggregated serving exact
            alone = _post(cluster.worker_urls("decode")[0] + "/v1/completions",
                          {k: v for k, v in body.items() if k != "pdserve_timings"})
            assert out["choices"][0]["text"] == alone["choices"][0]["text"]
    # every repeat reused the 10 cached blocks instead of computing them
    assert _counter(holder, "vllm:prefix_cache_hits_total") - hits_before >= 3 * 1280
    assert _counter(other, "vllm:prefix_cache_queries_total") == other_queries  # the other P computed nothing

    from tests.integration.router_replicas import listings

    # the four requests were placed by one replica or the other, each once
    assert sum(b["decisions"].get("disaggregated", 0) for b in listings(router).values()) == 4
    assert "pdserve_worker_queued_prefill_tokens{" in _get(router + "/metrics")


def test_router_replicas_share_the_fleet(cluster):
    """Both replicas index alike, membership changes through one reach both, a replica killed with SIGKILL costs
    no later request and comes back with the current set (tests/integration/router_replicas.py)."""
    from tests.integration.router_replicas import run_replica_case

    run_replica_case(cluster)
