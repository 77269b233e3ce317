"""The launch's default KV pool on the shared 1P1D stack (tests/integration/conftest.py: ``pd_cluster``), as
``pdserve serve`` starts it: a pool master and node, both workers on pdserve's connector (kv_both) with the
transfer secret kept out of their argv. P saves each prompt's full blocks to the pool while D reads them, and
frees them only when both are done (P's KV usage returns to 0); the same prompt again gives the same tokens.
(The launch's stop, pool included, is checked when the stack stops: ``pd_cluster``'s teardown.)"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

from pdserve.http_probe import http_status
from pdserve.launch import Cluster

from .test_pd_exactness import _prompt


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return out["choices"][0].get("token_ids") or out["choices"][0]["text"]


def check_launch_pool_saves_pd_prompts(c: Cluster) -> None:
    assert [p.name for p in c.pool] == ["pool-master", "pool-node"] and all(p.alive() for p in c.pool)
    assert [w.name for w in c.workers] == ["prefill0", "decode0"]
    assert all(w.connector for w in c.plan.workers)
    if len(os.sched_getaffinity(0)) > 1:
        assert c.plan.workers[0].cores != c.plan.workers[1].cores
    for w in c.workers:
        ktc = json.loads(w.argv[w.argv.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector"] == "PdserveConnector" and ktc["kv_role"] == "kv_both"
        assert c.secret not in " ".join(w.argv)
    assert http_status(c.router_url + "/health") == 200
    p_url = c.worker_urls("prefill")[0]
    pool_url = c.pool[0].url
    saved0 = _sum(_metrics(p_url), "vllm:pdserve_kv_pool_saved_blocks_total")
    puts0 = _sum(_metrics(pool_url), "pdserve_store_puts_total")
    prompt = _prompt(600, seed=1011)  # 4 full blocks no other test sends
    pd = _complete(c.router_url, c.model_name, prompt, 8)
    deadline = time.time() + 30
    while True:  # P keeps the blocks until D read them AND the pool save ended
        text = _metrics(p_url)
        usage = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
        saved = _sum(text, "vllm:pdserve_kv_pool_saved_blocks_total") - saved0
        if saved >= 4 and usage and float(usage.group(1)) == 0:
            break
        assert time.time() < deadline, f"P saved {saved} of 4 blocks to the pool or never freed its blocks"
        time.sleep(0.5)
    pool_metrics = _metrics(pool_url)
    assert _sum(pool_metrics, "pdserve_store_objects") >= 4
    assert _sum(pool_metrics, "pdserve_store_puts_total") - puts0 >= 4
    assert _complete(c.router_url, c.model_name, prompt, 8) == pd  # P's local cache and the pool agree
