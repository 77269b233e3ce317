"""`pdserve serve` with real vLLM servers (a tiny random-weight Llama), through the CLI. The Python API's 1P1D
launch (connector on both workers, pool, stop without SIGKILL) is checked on the shared 1P1D stack
(tests/integration/pool_launch.py, and ``pd_cluster``'s teardown in conftest.py).

Each test runs at most 2 vLLM servers and stops them; every check ends by proving that no process of the
launch (vLLM API servers, their engine-core children, the router, the reaper) is left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.http_probe import http_status
from pdserve.launch.procs import pids_in_group, wait_dead

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(600),
]

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 400  # vLLM takes ~35 s alone; much longer when other engineers' servers share the 2 cores


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from pdserve.launch.models import build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("launcher-model") / "tiny-llama", layers=2, hidden=256)





def _group_pids(pgids) -> list[int]:
    return sorted({p for g in pgids for p in pids_in_group(g)})


def _complete(url: str, model: str, prompt: str = "Hello, my name is", max_tokens: int = 4) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def _start_cli(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, dict, str]:
    run_dir = tmp_path / "run"
    err = open(tmp_path / "cli.err", "w")
    p = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", "--run-dir", str(run_dir),
         "--worker-timeout", str(START_TIMEOUT_S), *args],
        stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(tmp_path),
        # the production start (no warm starter, tests/conftest.py): vLLM's own CLI start, engine core spawned
        env=dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_WARM_START="0"),
    )
    err.close()
    banner = p.stdout.readline()
    if "pdserve is serving" not in banner:
        p.kill()
        p.wait()
        pytest.fail(f"pdserve serve did not start:\n{(tmp_path / 'cli.err').read_text()[-4000:]}")
    manifest = json.loads((run_dir / "launch.json").read_text())
    return p, manifest, banner


def _launch_pgids(manifest: dict) -> list[int]:
    # each child leads its own process group (pgid == pid)
    return [w["pid"] for w in manifest["workers"]] + [manifest["router"]["pid"]]


def test_cli_colocated_health_gates_on_workers_and_kill_9_leaves_nothing(tiny_model, tmp_path):
    """`pdserve serve --colocated 1`: the router (started alongside the worker) answers /health 200 only once
    the worker does; a request goes through; kill -9 of the launcher still takes down every process of the
    launch (PDEATHSIG + the reaper), vLLM's engine-core child included."""
    run_dir = tmp_path / "run"
    seen: list[tuple[int | None, int | None]] = []  # (router status, worker status), probed in that order
    done = threading.Event()

    def probe() -> None:
        manifest = None
        while not done.is_set():
            if manifest is None:
                try:
                    manifest = json.loads((run_dir / "launch.json").read_text())
                except (OSError, ValueError):
                    manifest = None
            if manifest is not None and manifest.get("router"):
                router = http_status(manifest["router_url"] + "/health", timeout_s=1)
                worker = http_status(manifest["workers"][0]["url"] + "/health", timeout_s=1)
                seen.append((router, worker))
            time.sleep(0.25)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        p, manifest, banner = _start_cli(tmp_path, "--model", str(tiny_model), "--colocated", "1")
    finally:
        done.set()
        t.join()
    print(f"colocated K=1 ready in {time.monotonic() - t0:.1f} s")
    try:
        url = manifest["router_url"]
        assert url in banner and manifest["mode"] == "colocated"
        assert "--kv-transfer-config" not in manifest["workers"][0]["argv"]
        assert http_status(url + "/health") == 200
        # the router never said healthy while the worker was not ...
        assert all(w == 200 for r, w in seen if r == 200), seen
        # ... and it was up, answering not-ready, while the worker loaded
        assert any(r is not None and r != 200 for r, _ in seen), seen
        out = _complete(url, manifest["model_name"])
        assert out["choices"][0]["text"] is not None
        pgids = _launch_pgids(manifest)
        pids = _group_pids(pgids)
        assert len(_group_pids(pgids[:1])) >= 2, "expected vLLM's engine-core child in the worker's group"
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    assert wait_dead(pids, 30.0) == []
    assert _group_pids(pgids) == []
    # the routers' shared membership (and its lock) stays, so a restarted launch's router keeps run-time members
    assert sorted(x.name for x in run_dir.iterdir()) == ["colocated0.log", "launch.json", "membership.json",
                                                          "membership.json.lock", "router.log"]
