"""The KV indexer service (``pdserve indexer``) on real vLLM workers' KV events (issue 39): it runs next to the
2P1D conductor stack (two router replicas, the pool), subscribed to the same publishers; under traffic it takes a
snapshot, is killed with SIGKILL, misses batches while down and restarts from the snapshot. It must then resume
every worker's stream from the snapshot's own batch (no clear, no re-learning), and its view must equal the
routers' (which never stopped) and the workers' truth: a prompt it says worker W holds N blocks of hits exactly
N blocks of W's vLLM prefix cache."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.prom import scrape

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
]

BLOCK = 128
ROOT = Path(__file__).resolve().parents[2]


def _post(url: str, body: Any, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


class Indexer:
    """``python -m pdserve.indexer`` as its own process (own session, killed in ``stop``)."""

    def __init__(self, entries: list[str], snap: Path, log: Path) -> None:
        from pdserve.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "pdserve.indexer", "--indexer-port", str(self.port),
                     "--indexer-snapshot", str(snap), "--indexer-snapshot-interval-s", "0",
                     *[a for e in entries for a in ("--kv-events", e)]]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(self.url + "/health")
                return
            except (urllib.error.URLError, ConnectionError):
                assert self.proc.poll() is None, f"indexer exited: {self.log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "indexer did not answer /health in 60 s"
                time.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Traffic(threading.Thread):
    """Requests through the router: prompts of three shared prefixes (2-6 blocks) and their own tails."""

    def __init__(self, router: str, n: int) -> None:
        super().__init__(daemon=True)
        rng = random.Random(39)
        families = [[rng.randrange(1000, 30000) for _ in range(6 * BLOCK)] for _ in range(3)]
        self.prompts = []
        for i in range(n):
            fam = families[i % 3][:BLOCK * rng.randrange(2, 7)]
            self.prompts.append(fam + [rng.randrange(1000, 30000) for _ in range(rng.randrange(20, 2 * BLOCK))])
        self.router, self.done, self.failed = router, 0, 0

    def run(self) -> None:
        for p in self.prompts:
            try:
                _post(self.router + "/v1/completions", {"model": "rl", "prompt": p, "max_tokens": 2,
                                                        "temperature": 0})
            except Exception:
                self.failed += 1
            self.done += 1

    def wait_for(self, n: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.done < n:
            assert time.monotonic() < deadline, f"only {self.done} of {n} requests done in {timeout_s} s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(pd_conductor):
    return pd_conductor  # tests/integration/conftest.py: 2P1D, two router replicas, the pool, one LoRA adapter


def _device_blocks(view: dict) -> dict[str, int]:
    return {w: t.get("device", 0) for w, t in view["blocks"].items() if w != "pool"}


def _router_blocks(router: str) -> dict[str, int]:
    body = _get(router + "/v1/pdserve/workers")
    return {w["url"]: w.get("indexed_blocks", 0) for w in body["workers"]}


def test_indexer_killed_under_traffic_resumes_exactly(cluster, tmp_path):
    from pdserve.launch.commands import kv_publisher_entry

    entries = [kv_publisher_entry(w) for w in cluster.plan.workers if w.kv_events_endpoint]
    assert len(entries) == 3
    router = cluster.router_url
    ix = Indexer(entries, tmp_path / "index.snap", tmp_path / "indexer.log")
    traffic = Traffic(router, 18)
    try:
        ix.start()
        traffic.start()
        traffic.wait_for(5)
        snap = _post(ix.url + "/snapshot", {})
        assert snap["bytes"] > 0 and snap["blocks"] > 0
        traffic.wait_for(8)
        ix.kill()  # no final snapshot: what it applied after the snapshot is lost with it
        traffic.wait_for(11)  # batches published while it is down reach it only through the replay buffers
        ix.start()
        view = _get(ix.url + "/global_view")
        assert view["snapshot"]["restored_blocks"] == snap["blocks"]
        traffic.join(600)
        assert traffic.failed == 0
        # its view settles on the routers' (they never stopped), worker by worker
        deadline = time.monotonic() + 60
        while True:
            view = _get(ix.url + "/global_view")
            mine, theirs = _device_blocks(view), _router_blocks(router)
            if all(mine.get(w, 0) == n for w, n in theirs.items()) and sum(theirs.values()) > 0:
                break
            assert time.monotonic() < deadline, f"indexer {mine} != routers {theirs}"
            time.sleep(0.5)
        # resumed from the snapshot's batches, not re-learned: no stream was cleared, each replayed from its point
        assert view["counters"]["clears"] == 0, view["counters"]
        assert view["counters"]["replayed"] > 0
        # the workers' truth: what it says a prefill worker holds of a prompt is what that worker's cache hits
        checked = 0
        for p in traffic.prompts[-6:]:
            found = _post(ix.url + "/query", {"model": "rl", "token_ids": p})["default"]
            for w in cluster.worker_urls("prefill"):
                held = found.get(w, {}).get("device", 0)
                before = scrape(w, "vllm:prefix_cache_hits_total").get("vllm:prefix_cache_hits_total", 0.0)
                _post(w + "/v1/completions", {"model": "rl", "prompt": p, "max_tokens": 1, "temperature": 0})
                after = scrape(w, "vllm:prefix_cache_hits_total").get("vllm:prefix_cache_hits_total", 0.0)
                assert after - before == held, f"{w}: indexer said {held} tokens, vLLM hit {after - before}"
                checked += held > 0
        assert checked > 0, "no prompt was held anywhere: nothing was compared"
    finally:
        ix.stop()
