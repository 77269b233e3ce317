"""Elastic roles end to end (issue 16, item 1): `pdserve serve --elastic 2` through the launcher (two real vLLM
workers, both kv_both with pdserve's connector, the router's conductor choosing per request) serves a mixed
batch of short and ~1000-token prompts with greedy output equal to one worker's, token for token; long prompts
are split P -> D (the KV moves through the connector), short ones run colocated."""

from __future__ import annotations

import importlib.util
import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.bench.prom import scrape
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
    pytest.mark.slow,  # two vLLM starts of its own; the same placement runs on test_pd_router.py's stack in CI
]

LONG_FROM = 256  # --local-prefill-tokens: a prompt over this many uncached tokens is long (split preferred)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdserve.launch.models import build_random_llama

    model = build_random_llama(tmp_path_factory.mktemp("elastic-model") / "random-llama")
    cfg = LauncherConfig(model=str(model), elastic=2, policy="conductor", port=0, dtype="float32",
                         max_model_len=2048, served_model_name="rl", pool=False, worker_timeout_s=400,
                         run_dir=str(tmp_path_factory.mktemp("elastic-run")),
                         router_args=("--no-calibrate", "--local-prefill-tokens", str(LONG_FROM)))
    with Cluster(cfg) as c:
        yield c


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _body(length: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"model": "rl", "prompt": [rng.randrange(1000, 40000) for _ in range(length)], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}


def _decisions(cluster: Cluster) -> dict[str, float]:
    got = scrape(cluster.router_url, "pdserve_conductor_decisions_total", labels=True)
    return {kind: sum(v for k, v in got.items() if f'kind="{kind}"' in k) for kind in ("local", "disaggregated")}


def test_elastic2_mixed_batch_equals_one_worker(cluster):
    urls = cluster.worker_urls("elastic")
    assert len(urls) == 2
    reads = sum(scrape(u, "vllm:pdserve_kv_reads_total").get("vllm:pdserve_kv_reads_total", 0.0) for u in urls)
    # on an idle pool a long prompt is split (P on one worker, D on the other) and a short one runs colocated
    first = [_body(1000, 1), _body(40, 2)]
    batch = [_body(n, 10 + i) for i, n in enumerate((1000, 60, 900, 30, 1000, 80))]
    routed = [_post(cluster.router_url, b) for b in first]
    with ThreadPoolExecutor(len(batch)) as pool:  # concurrent: the conductor sees prefills and decodes in flight
        routed += list(pool.map(lambda b: _post(cluster.router_url, b), batch))
    for b, out in zip(first + batch, routed):
        alone = _post(urls[0], b)  # the same request start to finish on one worker, no kv_transfer_params
        assert out["choices"][0]["text"] == alone["choices"][0]["text"], len(b["prompt"])
        assert out["usage"]["prompt_tokens"] == len(b["prompt"]) and out["usage"]["completion_tokens"] == 8
    kinds = _decisions(cluster)
    assert kinds["disaggregated"] >= 1 and kinds["local"] >= 1, kinds
    after = sum(scrape(u, "vllm:pdserve_kv_reads_total").get("vllm:pdserve_kv_reads_total", 0.0) for u in urls)
    assert after >= reads + 1  # a split request's KV was read through the connector
