"""Drafters with layers across the hand-off (issue 36, item 4), each on a real 1P1D stack of pdserve's connector,
fp32, with a drafter that mirrors its target so that acceptance reads the drafter's KV:

- a draft model (vLLM's ``draft_model`` method, 2 tokens a draft): the 2-layer random Llama drafting for itself;
- EAGLE (``eagle``, 2 tokens): an EAGLE head that copies a one-layer random Llama;
- MTP (``mtp``, 1 token): a one-layer random DeepSeek-V3 (MLA) whose checkpoint's MTP layer copies layer 0;
- EAGLE-3 (``eagle3``, 2 tokens): a random EAGLE-3 head for a 4-layer random Llama (no mirror: its layer adds the
  target's hidden states to its residual stream), so only its drafting and the output are checked

(:func:`pdserve.launch.models_drafters.drafter_stack` builds them all).

Each mirror predicts what the target predicts only when its attention over the earlier tokens sees the right KV
of its own layers. The launcher gives P the config, so P computes the drafter's KV for the prompt in its prefill;
vLLM allocates the drafter's layers in the same KV cache, so both workers register them with the connector and D
reads the drafter's KV with the target's (a fresh prompt: every block of every layer). Greedy output through P and
D equals P serving the whole request alone with the same config, on prompts that share a prefix, and D accepts as
many drafts as P alone does (most of them, as a mirror should; randomising the drafter's KV for 128 prompt tokens
in one worker took an EAGLE mirror from 10 of 10 to 2 of 26).
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
from pdserve.launch.models_drafters import DRAFTER_METHODS, MIRRORED, drafter_stack

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(600),
]


MIN_ACCEPTANCE = 0.6  # a mirror's drafts, where its KV is right (a corrupted drafter KV: ~0.1)
LLAMA_BLOCK = 2 * 128 * 2 * 64 * 4  # one layer's block: K,V x 128 tokens x 2 heads x 64 dims, fp32
MLA_BLOCK = 16 * 576 * 4  # one layer's block on CPU MLA: 16 tokens x (512 latent + 64 rope), fp32
# KV layers each worker registers (the target's and the drafter's), and what D reads for the fresh 150-token prompt
SHAPES = {"draft_model": (4, 2 * 4 * LLAMA_BLOCK), "eagle": (2, 2 * 2 * LLAMA_BLOCK), "eagle3": (5, 2 * 5 * LLAMA_BLOCK),
          "mtp": (2, 10 * 2 * MLA_BLOCK)}


@pytest.fixture(scope="module", params=DRAFTER_METHODS)
def stack(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"spec-{request.param}")
    model, spec, worker_args = drafter_stack(request.param, root)
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="m", run_dir=str(root / "run"), worker_timeout_s=400, restart=False,
                         pool=False, speculative_config=json.dumps(spec), worker_args=worker_args)
    with Cluster(cfg) as c:
        yield c, spec, SHAPES[request.param], request.param in MIRRORED


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _counter(url: str, name: str) -> float:
    return scrape(url, name).get(name + "_total", 0.0)


def _judged(url: str, tally: list[float], post_url: str, body: dict) -> dict:
    """The answer to ``body`` posted to ``post_url``; adds the draft tokens the worker at ``url`` judged and
    accepted meanwhile to ``tally``."""
    names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    before = [_counter(url, n) for n in names]
    result = _post(post_url, body)
    for i, (name, value) in enumerate(zip(names, before, strict=True)):
        tally[i] += _counter(url, name) - value
    return result


def test_the_drafter_s_kv_moves_with_the_hand_off_and_the_output_is_one_worker_s(stack):
    cluster, spec, (layers, fresh_bytes), mirrors = stack
    p, d = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    spec_tokens = spec["num_speculative_tokens"]
    logs = "".join((Path(cluster.run_dir) / f"{w}0.log").read_text(errors="replace") for w in ("prefill", "decode"))
    assert logs.count(f"registered {layers} KV layers") == 2, "both workers register the drafter's layers"
    rnd = random.Random(36)
    prefix = [rnd.randrange(1000, 40000) for _ in range(300)]
    prompts = [[rnd.randrange(1000, 40000) for _ in range(150)]] + [prefix + [rnd.randrange(1000, 40000)
                                                                              for _ in range(n)] for n in (20, 200)]
    pd_judged, alone_judged = [0.0, 0.0], [0.0, 0.0]
    for i, prompt in enumerate(prompts):
        body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        before = _counter(d, "vllm:pdserve_kv_read_bytes")
        pd = _judged(d, pd_judged, cluster.router_url + "/v1/completions", body)
        read = _counter(d, "vllm:pdserve_kv_read_bytes") - before
        assert read == fresh_bytes if i == 0 else read > 0, (len(prompt), read)  # the drafter's KV too
        alone = _judged(p, alone_judged, p + "/v1/completions", body)
        assert pd["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"], len(prompt)
    # vLLM pads a request that starts with one token to compute (D's first step after the read) with
    # num_speculative_tokens placeholder drafts, judged and rejected (vllm/v1/core/sched/scheduler.py, "Pad new
    # decode requests to uniform spec decoding size"): D judges up to that many more per request, and that round
    # gives one token where an accepted one gives more, so D may accept up to that many fewer
    assert pd_judged[0] > 0, "D drafted"
    if not mirrors:  # a random drafter: acceptance says nothing
        return
    pads = spec_tokens * len(prompts)
    assert alone_judged[0] <= pd_judged[0] <= alone_judged[0] + pads, (pd_judged, alone_judged)
    assert alone_judged[1] >= MIN_ACCEPTANCE * alone_judged[0] > 0, alone_judged  # the mirror drafts well
    assert pd_judged[1] >= alone_judged[1] - pads, (pd_judged, alone_judged)  # so does D, on the drafter's KV from P
