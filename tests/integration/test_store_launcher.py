"""`Cluster` (what `pdserve serve` runs) with its default KV pool, 1P1D through the router.

Both workers load the pdserve connector (kv_both) on their own core, with the transfer secret kept out of their
argv. The launch starts a pool master + node; P saves each prompt's full blocks to the pool while the decode
worker reads them, and frees them only when both are done (P's KV usage returns to 0); the output through
the pool-enabled path equals a plain worker's; stop() (SIGTERM to every process group, SIGKILL only after
stop_timeout_s) ends every process of the launch, pool included, with no SIGKILL needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.config import LauncherConfig
from pdserve.http_probe import http_status
from pdserve.launcher import Cluster
from pdserve.procs import pids_in_group, wait_dead

from .test_pd_exactness import _prompt

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


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


def test_serve_starts_a_pool_and_pd_requests_save_to_it(tmp_path: Path) -> None:
    from pdserve.models import build_random_llama

    model = build_random_llama(tmp_path / "tiny", layers=2, hidden=256)
    cfg = LauncherConfig(model=str(model), port=0, dtype="float32", pool_mem="64MiB", pool_disk="64MiB",
                         run_dir=str(tmp_path / "run"), worker_timeout_s=400)
    prompt = _prompt(600, seed=11)  # 4 full blocks
    log: list[str] = []
    with Cluster(cfg, log=log.append) as c:
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
        pd = _complete(c.router_url, c.model_name, prompt, 8)
        p_url = c.worker_urls("prefill")[0]
        deadline = time.time() + 30
        while True:  # P keeps the blocks until D read them AND the pool save ended
            text = _metrics(p_url)
            usage = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
            if _sum(text, "vllm:pdserve_kv_pool_saved_blocks_total") >= 4 and usage and float(usage.group(1)) == 0:
                break
            assert time.time() < deadline, "P never saved to the pool or never freed its blocks"
            time.sleep(0.5)
        pool_metrics = urllib.request.urlopen(c.pool[0].url + "/metrics", timeout=5).read().decode()
        assert _sum(pool_metrics, "pdserve_store_objects") >= 4
        assert _sum(pool_metrics, "pdserve_store_puts_total") >= 4
        # the same prompt again: same tokens (P's local cache and the pool agree)
        assert _complete(c.router_url, c.model_name, prompt, 8) == pd
        pgids = c.pgids()
        pids = sorted({p for g in pgids for p in pids_in_group(g)}) + [c._reaper.proc.pid]
        ssd = tmp_path / "run" / "pool-ssd"
    assert wait_dead(pids, 30) == [], "processes of the launch left behind"
    assert sorted({p for g in pgids for p in pids_in_group(g)}) == []
    assert not any("got SIGKILL" in line for line in log), log  # vLLM, the router and the pool exit on SIGTERM
    assert not ssd.exists(), "the launcher's own SSD folder is removed at stop"
