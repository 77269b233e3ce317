"""Speculative decoding with a drafter that has layers, across the hand-off (issue 36, item 4): a draft model
(vLLM's ``draft_model`` method: a 1-layer random Llama drafting for a 2-layer one, fp32) on a real 1P1D stack.

The launcher gives P the config too, so P computes the drafter's KV in its prefill; vLLM allocates the drafter's
layer in the same KV cache, so pdserve's connector registers 3 layers on both workers and D reads the drafter's KV
with the target's (no recompute on D, which vLLM's NixlConnector would need: vllm#54926). Greedy output through P
and D equals P serving the whole request alone with the same config, on prompts that share a prefix; D drafted.
"""

from __future__ import annotations

import importlib.util
import json
import random
import urllib.request
from pathlib import Path

import pytest

from pdserve.bench.prom import scrape
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig
from pdserve.launch.models import build_random_llama

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(600),
]

BLOCK_BYTES = 3 * 2 * 128 * 128 * 4  # 3 layers (2 target + 1 drafter) x K,V x 128 tokens x 2 heads x 64 dims, fp32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-draft")
    target = build_random_llama(root / "target", layers=2)
    draft = build_random_llama(root / "draft", layers=1, seed=1)
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    cfg = LauncherConfig(model=str(target), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="m", run_dir=str(root / "run"), worker_timeout_s=400, restart=False,
                         pool=False, speculative_config=spec)
    with Cluster(cfg) as c:
        yield c


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _counter(url: str, name: str) -> float:
    return scrape(url, name).get(name + "_total", 0.0)


def test_a_draft_model_s_kv_moves_with_the_hand_off_and_the_output_is_one_worker_s(cluster):
    p, d = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    logs = "".join((Path(cluster.run_dir) / f"{w}0.log").read_text(errors="replace") for w in ("prefill", "decode"))
    assert logs.count("registered 3 KV layers") == 2, "both workers register the drafter's layer with the connector"
    rnd = random.Random(36)
    prefix = [rnd.randrange(1000, 40000) for _ in range(300)]
    prompts = [[rnd.randrange(1000, 40000) for _ in range(150)]] + [prefix + [rnd.randrange(1000, 40000)
                                                                              for _ in range(n)] for n in (20, 200)]
    drafts = _counter(d, "vllm:spec_decode_num_draft_tokens")
    for i, prompt in enumerate(prompts):
        body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        before = _counter(d, "vllm:pdserve_kv_read_bytes")
        out = _post(cluster.router_url + "/v1/completions", body)["choices"][0]["token_ids"]
        if i == 0:  # a fresh 150-token prompt: D read P's two blocks of all three layers
            assert _counter(d, "vllm:pdserve_kv_read_bytes") - before == 2 * BLOCK_BYTES
        assert out == _post(p + "/v1/completions", body)["choices"][0]["token_ids"], len(prompt)
    assert _counter(d, "vllm:spec_decode_num_draft_tokens") > drafts  # D drafted (random weights: few accepted)
