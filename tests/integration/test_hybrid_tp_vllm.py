"""A hybrid KV cache under tensor parallelism, P TP=2 -> D TP=2 (issue 36): rank r of D reads rank r of P, every
KV cache group, and the answers equal P's alone and a TP=1 worker's, token for token.

Granite-4 hybrid's shape (Mamba2 on 3 of 4 layers + attention, MoE, fp32; ``pdserve.launch.model_families``),
one 1P1D stack through ``pdserve serve``'s launcher with ``prefill_tp=decode_tp=2`` (four vLLM ranks on two shared
cores, no pool: the pool is TP=1 only), prompts sharing a 300-token prefix. Another TP pairing is refused by the
connector (no head slicing of a hybrid cache: tests/unit/test_vllm_groups.py). Minutes to start on two busy cores,
so it runs with ``PDSERVE_TEST_SLOW=1``.
"""

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
    pytest.mark.timeout(1200),
]

GEN = 8
# Granite-4 hybrid's greedy answers on one TP=1 plain vLLM worker (fp32, this model: build_family's seed 0) for the
# first and last prompt of _prompts(), measured with vLLM's offline LLM; TP=2 answers them alike
TP1 = {0: [13905, 47863, 46628, 44457, 14383, 2426, 42434, 21901],
       3: [47687, 46247, 24725, 3312, 4065, 381, 45968, 17946]}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _prompts() -> list[list[int]]:
    """benchmarks/hybrid_matrix.py's: three sharing a 300-token prefix, one fresh."""
    rnd = random.Random(36)
    prefix = [rnd.randrange(1000, 40000) for _ in range(300)]
    out = [prefix + [rnd.randrange(1000, 40000) for _ in range(n)] for n in (20, 200, 700)]
    return out + [[rnd.randrange(1000, 40000) for _ in range(150)]]


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory):
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig
    from pdserve.launch.model_families import FAMILIES, build_family

    spec = FAMILIES["granitehybrid"]
    model = build_family("granitehybrid", tmp_path_factory.mktemp("granite-model") / "granitehybrid")
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype=spec.dtype, max_model_len=2048,
                         served_model_name="m", run_dir=str(tmp_path_factory.mktemp("granite-tp-run")),
                         worker_timeout_s=900, pool=False, restart=False, worker_args=spec.worker_args,
                         prefill_tp=2, decode_tp=2, cores=(0, 1))
    with Cluster(cfg) as c:
        yield c


def test_tp2_to_tp2_hybrid_hand_off_equals_one_worker(tp_stack):
    c = tp_stack
    p_url, d_url = c.worker_urls("prefill")[0], c.worker_urls("decode")[0]
    for i, prompt in enumerate(_prompts()):
        body = {"model": "m", "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        before = scrape(d_url, "vllm:pdserve_kv_read_bytes").get("vllm:pdserve_kv_read_bytes_total", 0.0)
        routed = _post(c.router_url + "/v1/completions", body)["choices"][0]["token_ids"]
        after = scrape(d_url, "vllm:pdserve_kv_read_bytes").get("vllm:pdserve_kv_read_bytes_total", 0.0)
        assert after > before, f"prompt {i}: D (TP=2) read nothing from P (TP=2)"
        alone = _post(p_url + "/v1/completions", body)["choices"][0]["token_ids"]
        assert routed == alone, f"prompt {i} ({len(prompt)} tokens): TP 2 -> 2 differs from P alone"
        if i in TP1:
            assert routed == TP1[i], f"prompt {i}: TP 2 -> 2 differs from one TP=1 worker"
    text = "".join(w.log_path.read_text(errors="replace") for w in c.workers)
    assert "Turning off hybrid kv cache manager" not in text
