"""A MoE model under tensor parallelism through PD on CPU (issue 36): ``pdserve serve`` 1P1D with TP 2 on both
pools on a tiny random Qwen3-MoE in fp32 (``pdserve.launch.models_moe``): D reads P's KV, and the router's greedy
answers equal P's own (a TP 2 vLLM worker serving the whole request) token for token, on prompts sharing a prefix
and fresh ones. Expert parallelism (``--prefill-ep --decode-ep``) is refused on CPU workers
(pdserve/launch/config_experts.py: vLLM 0.32's CPU MoE kernel ignores the expert map, and a plain vLLM CPU worker
with TP 2 + ``--enable-expert-parallel`` segfaults in its first forward on this model; benchmarks/ep_exactness.py
records it). Four vLLM ranks on two shared cores: minutes, so ``PDSERVE_TEST_SLOW=1``.
"""

from __future__ import annotations

import importlib.util
import json
import urllib.request

import pytest

from pdserve.bench.prom import scrape

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(1500),
]

GEN = 8


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _prompts() -> list[list[int]]:
    import random

    rnd = random.Random(364)
    prefix = [rnd.randrange(1000, 40000) for _ in range(300)]
    shared = [prefix + [rnd.randrange(1000, 40000) for _ in range(n)] for n in (20, 200)]
    return shared + [[rnd.randrange(1000, 40000) for _ in range(150)]]


def test_moe_tp2_pd_equals_the_same_worker_alone(tmp_path_factory):
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig
    from pdserve.launch.models_moe import build_random_qwen3_moe

    model = build_random_qwen3_moe(tmp_path_factory.mktemp("qwen3moe") / "qwen3moe")
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="m", run_dir=str(tmp_path_factory.mktemp("ep-run")), worker_timeout_s=1200,
                         pool=False, restart=False, prefill_tp=2, decode_tp=2)
    with Cluster(cfg) as c:
        p_url, d_url = c.worker_urls("prefill")[0], c.worker_urls("decode")[0]
        for i, prompt in enumerate(_prompts()):
            body = {"model": "m", "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            before = scrape(d_url, "vllm:pdserve_kv_read_bytes").get("vllm:pdserve_kv_read_bytes_total", 0.0)
            routed = _post(c.router_url + "/v1/completions", body)["choices"][0]["token_ids"]
            after = scrape(d_url, "vllm:pdserve_kv_read_bytes").get("vllm:pdserve_kv_read_bytes_total", 0.0)
            alone = _post(p_url + "/v1/completions", body)["choices"][0]["token_ids"]
            assert after > before, f"prompt {i}: D read none of P's KV"
            assert routed == alone, f"prompt {i} ({len(prompt)} tokens): P -> D differs from P alone"
