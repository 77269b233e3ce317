"""MLA through P and D: a tiny random DeepSeek-V3 (MLA + MoE, fp32, 3 layers) served by ``pdserve serve`` 1P1D
(pdserve's connector, the KV pool on, as a user gets it) equals one plain vLLM worker, token for token, on prompts
that share a prefix with earlier ones and on fresh ones (issue 36, item 2).

On CPU vLLM turns prefix caching and chunked prefill off for MLA, and its CPU MLA prefill and decode passes do not
compute the same KV (the prefill caches most keys' rope part unrotated): KV loaded from the pool under a prompt's
suffix made P compute that suffix in a pass vLLM never runs there, and every shared-prefix prompt came back wrong
with HTTP 200. The connector now follows the engine (pdserve/vllm/scheduler.py, ``prefix_caching``): no pool on
such a worker, P's KV taken only for the step after P's prompt. The test also checks that D really read every
hand-off's KV from P, so it cannot pass by D computing the prompts itself.

Both stacks start through the launcher (plain: ``colocated=1`` without the connector) with
``--attention-backend CPU_MLA``: on AMX hosts vLLM picks its AMX MLA backend, which takes bf16 only.
"""

from __future__ import annotations

import json
import random
import re
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]

try:  # vLLM present and importable
    import vllm  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm not importable: {exc}", allow_module_level=True)

GEN = 8
WORKER_ARGS = ("--attention-backend", "CPU_MLA")


def prompts() -> list[list[int]]:
    """Fresh prompts and prompts that share a 300-token prefix (18 whole 16-token blocks and 12 tokens), one of
    them twice, with suffixes of 1 to 40 tokens: a suffix of one token is a single-token pass after a loaded
    prefix, the case where vLLM's two CPU MLA passes differ most."""
    rng = random.Random(36)
    words = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    prefix = words(300)
    return [words(57), prefix + words(5), prefix[:288] + [5000], words(130), prefix + words(40),
            prefix[:288] + [5000], prefix[:288] + [6000], prefix + words(1)]


def complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        assert r.status == 200
        return json.loads(r.read())["choices"][0]["token_ids"]


def serve(model: Path, run_dir: Path, **mode) -> list[list[int]]:
    """Every prompt's greedy tokens through a launch of ``mode``, in order."""
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig

    cfg = LauncherConfig(model=str(model), port=0, dtype="float32", max_model_len=2048, served_model_name="m",
                         run_dir=str(run_dir), worker_timeout_s=400, worker_args=WORKER_ARGS, **mode)
    with Cluster(cfg) as c:
        return [complete(c.router_url, p) for p in prompts()]


def test_mla_through_p_and_d_with_the_pool_equals_one_worker(tmp_path):
    from pdserve.launch.models_mla import build_random_deepseek_v3

    model = build_random_deepseek_v3(tmp_path / "dsv3")
    plain = serve(model, tmp_path / "plain", colocated=1, connector=False)
    pd = serve(model, tmp_path / "pd", prefill=1, decode=1, pool_mem="256MiB")
    for i, (want, got) in enumerate(zip(plain, pd)):
        assert got == want, f"prompt {i} ({len(prompts()[i])} tokens): 1P1D {got} vs one worker {want}"
    decode_log = (tmp_path / "pd" / "decode0.log").read_text(errors="replace")
    reads = re.findall(r"rank 0 read (\d+) blocks", decode_log)
    assert len(reads) == len(plain), f"D read {len(reads)} hand-offs of {len(plain)}: {reads}"
    prefill_log = (tmp_path / "pd" / "prefill0.log").read_text(errors="replace")
    assert "the KV pool is not used by this worker" in prefill_log
    assert "from the KV pool" not in prefill_log
