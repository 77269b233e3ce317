"""Supervision through the launcher with real vLLM workers (a tiny random Llama), one 1P1D stack with the KV pool
for every check: kill -9 of the decode worker -> restarted on its port, re-admitted by the router (/ready 200, a
request served through P and D); a pool node that crashes at every start -> given up after N restarts while the
rest keeps serving; stop() -> nothing restarted, nothing left."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.http_probe import http_status
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig
from pdserve.launch.procs import pids_in_group, wait_dead
from pdserve.launch.supervisor import UP
from pdserve.prom import families

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
    # ~55 s of vLLM restarts: slow tier (PDSERVE_TEST_SLOW=1). In CI the same launcher supervision runs on real
    # (non-vLLM) processes in tests/unit/test_supervisor_cluster.py, and real vLLM faults in test_router_faults.py
    pytest.mark.slow,
]

START_TIMEOUT_S = 400


def _complete(url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())["choices"][0]["text"]


def _metric(cluster: Cluster, name: str, process: str) -> float:
    with urllib.request.urlopen(cluster.metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for _, _, samples in families(text):
        for sample in samples:
            if sample.name == name and sample.labels.get("process") == process:
                return float(sample.value)
    raise AssertionError(f"no {name}{{process={process!r}}} in the launcher's /metrics:\n{text}")


def _ready_status(url: str) -> tuple[int | None, str | None]:
    """The router's /ready: (HTTP status, its body's "status")."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=5) as r:
            return r.status, json.loads(r.read()).get("status")
    except Exception as e:  # HTTPError carries the 503 body
        code = getattr(e, "code", None)
        try:
            return code, json.loads(e.read()).get("status") if code else None  # type: ignore[attr-defined]
        except Exception:
            return code, None


def _wait(what: str, cond, timeout_s: float, log: list[str]) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s:g} s; launcher log:\n" + "\n".join(log[-30:]))
        time.sleep(0.25)
    return time.monotonic() - t0


def test_launcher_restarts_a_killed_worker_gives_up_a_crash_loop_and_stops_cleanly(tmp_path):
    from pdserve.launch.models import build_random_llama

    model = build_random_llama(tmp_path / "tiny-llama", layers=2, hidden=256)
    run_dir = tmp_path / "run"
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, run_dir=str(run_dir), dtype="float32",
                         worker_timeout_s=START_TIMEOUT_S, router_args=("--health-interval-s", "0.5"),
                         restart_backoff_s=0.2, restart_backoff_max_s=1.0, crash_loop_restarts=2,
                         crash_loop_window_s=120)
    log: list[str] = []
    cluster = Cluster(cfg, log=log.append)
    with cluster:
        cluster.supervise_in_background(interval_s=0.2)
        url, name = cluster.router_url, cluster.model_name
        before = _complete(url, name)
        manifest = json.loads((run_dir / "launch.json").read_text())
        assert manifest["metrics_url"] == cluster.metrics_url
        assert {p["name"] for p in manifest["pool"]} == {"pool-master", "pool-node"}

        # 1. kill -9 of D's API server: restarted on the same URL, the router takes it back
        decode = cluster.workers[1]
        old_pid, d_url = decode.pid, decode.url
        os.kill(old_pid, signal.SIGKILL)
        # P serves whole requests meanwhile: /ready stays 200, "degraded" (issue 14's survivors)
        _wait("the router to see decode0 gone", lambda: _ready_status(url) == (200, "degraded"), 30, log)
        t_back = _wait("decode0 restarted and re-admitted",
                       lambda: cluster.supervisor.state("decode0") == UP and _ready_status(url) == (200, "ready"),
                       START_TIMEOUT_S, log)
        print(f"decode0 back in the router {t_back:.1f} s after its kill was seen")
        new = cluster.workers[1]
        assert new.pid != old_pid and new.url == d_url and new.name == "decode0"
        assert _complete(url, name) == before  # served through P and the restarted D, same greedy output
        assert _metric(cluster, "pdserve_process_restarts_total", "decode0") == 1
        assert _metric(cluster, "pdserve_process_up", "decode0") == 1
        assert (run_dir / "decode0.log.1").stat().st_size > 0 and (run_dir / "decode0.log").exists()
        manifest = json.loads((run_dir / "launch.json").read_text())
        assert [w["pid"] for w in manifest["workers"]] == [cluster.workers[0].pid, new.pid]

        # 2. a process that exits at once at every start: the pool node (a cache; serving goes on without it)
        crash = (sys.executable, "-c", "import sys; print('pool node: cannot start', flush=True); sys.exit(3)")
        plan = cluster.plan
        cluster.plan = dataclasses.replace(plan, processes=tuple(
            dataclasses.replace(p, argv=crash) if p.name == "pool-node" else p for p in plan.processes))
        os.killpg(cluster.pool[1].pgid, signal.SIGKILL)
        _wait("pool-node given up", lambda: cluster.given_up() == ["pool-node"], 60, log)
        assert any("pool-node" in line and "crash loop: 2 restarts within 120 s: giving it up" in line
                   for line in log), log[-10:]
        assert _metric(cluster, "pdserve_process_crash_loop", "pool-node") == 1
        assert _metric(cluster, "pdserve_process_restarts_total", "pool-node") == 2
        assert (run_dir / "pool-node.log.1").read_text() == "pool node: cannot start\n"
        assert all(c.alive() for c in cluster.workers) and cluster.router.alive()
        assert _complete(url, name) == before  # the rest keeps serving
        pgids = cluster.pgids()
        mark = len(log)
    # 3. an orderly stop restarts nothing and leaves no process
    assert not any("restart" in line for line in log[mark:]), log[mark:]
    assert wait_dead([p for g in pgids for p in pids_in_group(g)], 30) == []
    assert http_status(cluster.metrics_url + "/metrics", timeout_s=1) is None
    assert sorted(p.name for p in Path(run_dir).glob("decode0.log*")) == ["decode0.log", "decode0.log.1"]
