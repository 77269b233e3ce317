"""Layer-wise KV (issue 37 item 2) under chunked prefill: P prefills in 512-token chunks (the last chunk's forward
announces every layer of the whole prompt as it writes it), prompts that share a prefix (D reads only the blocks its
prefix cache lacks), greedy fp32 through the router equals D alone, token for token, and D read them layer by layer.
Slow (a stack of its own): it runs with PDSERVE_TEST_SLOW=1 (tests/conftest.py); the default tier covers layer-wise
reads on the shared stack (test_pd_router.py's early-dispatch test), where prompts fit one chunk."""

from __future__ import annotations

import importlib.util
import json
import random
import urllib.request

import pytest

from pdserve.bench.prom import scrape

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig
    from pdserve.launch.models import build_random_llama

    model = build_random_llama(tmp_path_factory.mktemp("lw-model") / "random-llama", layers=3)
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=4096,
                         served_model_name="m", run_dir=str(tmp_path_factory.mktemp("lw-run")), worker_timeout_s=400,
                         pool=False, max_num_batched_tokens=512)
    with Cluster(cfg) as c:
        yield c


def _text(url: str, body: dict) -> str:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]["text"]


def _count(url: str, name: str) -> float:
    return scrape(url, name).get(name, 0.0)


def test_chunked_prefills_read_layer_by_layer_equal_d_alone(stack):
    rng = random.Random(37)
    d = stack.worker_urls("decode")[0]
    _text(stack.router_url, {"model": "m", "prompt": [rng.randrange(1000, 40000) for _ in range(40)],
                             "max_tokens": 2, "temperature": 0})  # the router learns P's engine: early from now on
    before = _count(d, "vllm:pdserve_kv_layerwise_reads_total")
    prefix = [rng.randrange(1000, 40000) for _ in range(700)]
    for n in (1500, 2300, 900):
        body = {"model": "m", "prompt": prefix + [rng.randrange(1000, 40000) for _ in range(n)], "max_tokens": 16,
                "temperature": 0, "ignore_eos": True}
        assert _text(stack.router_url, body) == _text(d, body), n
    assert _count(d, "vllm:pdserve_kv_layerwise_reads_total") - before == 3
    assert _count(d, "vllm:pdserve_kv_read_failures_total") == 0
