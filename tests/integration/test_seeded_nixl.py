"""Seeded sampling continued across a migration on vLLM's NixlConnector (issue 41): its workers load no pdserve
connector, so the draws a migrated request skips (``vllm_xargs.pdserve_rng_skip``) are installed there by vLLM's
plugin entry point (pdserve/vllm/rng_skip.py, ``PDSERVE_RNG_SKIP`` set by the launcher).

A real ``--kv-connector nixl`` 1P1D launch of a small random Llama with flat logits (``lm_head_std`` 0.05: sampling
at temperature 1 is really random there). Checked: a D worker continuing a seeded request after k of its own
tokens with the skip gives the tokens it gave after them in one go (and, the baseline, without the skip it does
not); and a real migration: D is killed mid-stream, the router moves the request to P (the survivor), and the
whole output equals P's answer to the request in one go. Slow tier (its own stack, a worker killed):
``PDSERVE_TEST_SLOW=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import urllib.request

import pytest

from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
]

try:
    import nixl  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"nixl is not importable ({exc}): vLLM's NixlConnector needs it", allow_module_level=True)

K = 5  # tokens output before the continued attempt


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdserve.launch.models import build_random_llama

    model = build_random_llama(tmp_path_factory.mktemp("seeded-nixl") / "random-llama-flat", lm_head_std=0.05)
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="m", kv_connector="nixl", lease_s=20, pool=False,
                         run_dir=str(tmp_path_factory.mktemp("seeded-nixl-run")), worker_timeout_s=400,
                         restart=False)  # the killed D stays dead: the request must move
    with Cluster(cfg) as c:
        yield c


def _choice(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())["choices"][0]


def _body(seed: int, extra: dict | None = None, max_tokens: int = 16) -> dict:
    return {"model": "m", "prompt": f"Case {seed}: once upon a time", "max_tokens": max_tokens, "temperature": 1.0,
            "seed": 1000 + seed, "ignore_eos": True, "return_token_ids": True, **(extra or {})}


def test_a_nixl_worker_continues_a_seeded_stream(cluster):
    d = cluster.worker_urls("decode")[0]
    continued = restarted = 0
    cases = [(seed, extra) for seed in range(3) for extra in ({}, {"top_k": 20})]
    for seed, extra in cases:
        body = _body(seed, extra)
        ref = _choice(d, body)
        more = {**body, "prompt": list(ref["prompt_token_ids"]) + list(ref["token_ids"][:K]),
                "max_tokens": body["max_tokens"] - K}
        continued += _choice(d, {**more, "vllm_xargs": {"pdserve_rng_skip": K}})["token_ids"] == ref["token_ids"][K:]
        restarted += _choice(d, more)["token_ids"] == ref["token_ids"][K:]
    assert continued == len(cases)
    assert restarted < len(cases)  # without the skip the stream restarts: the model's sampling is really random


def test_a_seeded_request_migrated_off_a_killed_d_equals_one_go(cluster):
    p = cluster.worker_urls("prefill")[0]
    body = _body(7, max_tokens=400)
    ref = _choice(p, body)["token_ids"]  # P alone, in one go (no kv_transfer_params: a plain vLLM worker)
    req = urllib.request.Request(cluster.router_url + "/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    got: list[int] = []
    killed = False
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for c in json.loads(line[5:]).get("choices", []):
                got += c.get("token_ids") or []
            if not killed and len(got) >= K:
                decode = next(w for w in cluster.workers if w.name == "decode0")
                os.killpg(decode.pid, signal.SIGKILL)  # D's API server and engine core, mid-stream
                decode.proc.wait(timeout=30)
                killed = True
    assert killed and len(got) == len(ref)
    metrics = urllib.request.urlopen(cluster.router_url + "/metrics", timeout=10).read().decode()
    assert any(line.startswith("pdserve_router_migrations_total") and not line.rstrip().endswith(" 0.0")
               for line in metrics.splitlines()), "the request did not migrate"
    assert got == ref
