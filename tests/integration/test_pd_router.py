"""The whole disaggregated path as a client sees it: `pdserve` cluster (1P1D with the connector, router in
front), checked against the decode worker serving the same request alone, and a client that leaves mid-stream."""

from __future__ import annotations

import importlib.util
import json
import random
import time
import urllib.request

import pytest

from pdserve.bench.prom import scrape
from pdserve.config import LauncherConfig
from pdserve.launcher import Cluster

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
]
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdserve.models import build_random_llama

    model = build_random_llama(tmp_path_factory.mktemp("pd-router-model") / "random-llama")
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="rl", run_dir=str(tmp_path_factory.mktemp("pd-router-run")),
                         worker_timeout_s=400)
    with Cluster(cfg) as c:
        yield c


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _alone(cluster: Cluster, path: str, body: dict) -> dict:
    """The same request served start to finish by the decode worker alone (no kv_transfer_params)."""
    return _post(cluster.worker_urls("decode")[0] + path, body)


def _metric(url: str, name: str) -> float:
    return scrape(url, name).get(name, 0.0)


@pytest.mark.parametrize("length", [100, 1000])
def test_router_pd_output_equals_one_worker(cluster, length):
    ids = [random.Random(length).randrange(1000, 40000) for _ in range(length)]
    body = {"model": "rl", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reads_before = _metric(cluster.worker_urls("decode")[0], "vllm:pdserve_kv_reads_total")
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
    kw = {k: v for k, v in body.items() if k != "ignore_eos"}
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True,
                                                                            extra_body={"ignore_eos": True})
                       if c.choices)
    reference = _alone(cluster, "/v1/completions", body)["choices"][0]["text"]
    assert plain.choices[0].text == streamed == reference
    assert plain.usage.prompt_tokens == length and plain.usage.completion_tokens == 16
    assert _metric(cluster.worker_urls("decode")[0], "vllm:pdserve_kv_reads_total") >= reads_before + 2


def test_router_pd_chat_equals_one_worker(cluster):
    body = {"model": "rl", "messages": [{"role": "user", "content": "Name three colours, please."}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                         extra_body={"ignore_eos": True})
    reference = _alone(cluster, "/v1/chat/completions", body)
    assert out.choices[0].message.content == reference["choices"][0]["message"]["content"]
    assert out.usage.prompt_tokens == reference["usage"]["prompt_tokens"]


def test_client_leaving_mid_stream_frees_blocks_on_both_workers(cluster):
    p_url, d_url = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    released = _metric(p_url, "vllm:pdserve_kv_released_notified_total")
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
    ids = [random.Random(7).randrange(1000, 40000) for _ in range(600)]
    stream = client.completions.create(model="rl", prompt=ids, max_tokens=1400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 5:
            break
    stream.close()
    deadline = time.monotonic() + 20  # well inside P's 30 s lease: freeing must come from the hand-off
    def usage() -> tuple[float, float]:
        return _metric(p_url, "vllm:kv_cache_usage_perc"), _metric(d_url, "vllm:kv_cache_usage_perc")

    while usage() != (0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert usage() == (0.0, 0.0), "KV blocks still held after the client left"
    assert _metric(d_url, "vllm:num_requests_running") == 0
    assert _metric(p_url, "vllm:pdserve_kv_released_notified_total") == released + 1
    assert json.loads(urllib.request.urlopen(cluster.router_url + "/health", timeout=10).read())["status"] == "ok"
