"""Supervision of a whole launch without vLLM: the launcher starts a fake worker and router (tiny HTTP servers,
real processes), and its supervisor restarts what is killed (same port, log kept, /metrics counted), gives up a
worker that crashes at every start while the rest keeps serving, and restarts nothing during SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.http_probe import http_status
from pdserve.launch import Cluster, commands
from pdserve.launch.config import LauncherConfig
from pdserve.launch.procs import pid_alive, wait_dead

ROOT = Path(__file__).resolve().parents[2]

FAKE_SERVER = r'''
"""Stands in for vLLM and the router: /health 200; exits at once while the file --fail-if names exists."""
import argparse, http.server, os, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--fail-if", default="")
p.add_argument("--grandchild", action="store_true")
a, rest = p.parse_known_args()
if a.fail_if and os.path.exists(a.fail_if):
    print("boom: cannot start", flush=True)
    sys.exit(3)
if a.grandchild:
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("GRANDCHILD", g.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/ready") else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer.allow_reuse_address = True
srv = http.server.HTTPServer((a.host, a.port), H)
print("SERVING", a.port, flush=True)
srv.serve_forever()
'''

CLI_WRAPPER = r'''
import sys
import pdserve.launch.commands as L
L.VLLM_SERVER_MODULE = L.ROUTER_MODULE = "fake_server"
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture
def fakes(tmp_path, monkeypatch) -> Path:
    mods = tmp_path / "fakemods"
    mods.mkdir()
    (mods / "fake_server.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.setattr(commands, "VLLM_SERVER_MODULE", "fake_server")
    monkeypatch.setattr(commands, "ROUTER_MODULE", "fake_server")
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _until(cond, timeout_s: float = 20.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _metric(metrics_url: str, name: str, process: str) -> float | None:
    from pdserve.prom import parse

    with urllib.request.urlopen(metrics_url + "/metrics", timeout=5) as r:
        return parse(r.read().decode(), name, labels=True).get(f'{name}{{process="{process}"}}')


def test_cluster_restarts_a_killed_worker_on_its_port_and_keeps_its_log(fakes, tmp_path):
    run = tmp_path / "run"
    cfg = LauncherConfig(model=str(fakes), colocated=2, port=0, run_dir=str(run), stop_timeout_s=5,
                         worker_args=("--grandchild",), restart_backoff_s=0.1)
    log: list[str] = []
    with Cluster(cfg, log=log.append) as c:
        c.supervise_in_background(0.05)
        assert json.loads((run / "launch.json").read_text())["metrics_url"] == c.metrics_url
        assert _metric(c.metrics_url, "pdserve_process_restarts_total", "colocated1") == 0
        old = c.workers[1]
        grandchild = int((run / "colocated1.log").read_text().split("GRANDCHILD ")[1].split()[0])
        os.kill(old.pid, signal.SIGKILL)
        _until(lambda: c.workers[1] is not old and c.supervisor.state("colocated1") == "up", what="restart")
        new = c.workers[1]
        assert new.url == old.url and http_status(new.url + "/health") == 200
        assert wait_dead([grandchild], 5) == []  # the old group's leftovers are killed before the restart
        assert "SERVING" in (run / "colocated1.log.1").read_text()
        _until(lambda: "SERVING" in (run / "colocated1.log").read_text(), what="the new log")
        assert _metric(c.metrics_url, "pdserve_process_restarts_total", "colocated1") == 1
        assert _metric(c.metrics_url, "pdserve_process_up", "colocated1") == 1
        assert json.loads((run / "launch.json").read_text())["workers"][1]["pid"] == new.pid
        assert any("colocated1 is healthy again" in line for line in log)
        pids = [ch.pid for ch in c.children()]
    assert wait_dead(pids, 10) == []


def _start_cli(model: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{tmp_path / 'fakemods'}")
    with open(tmp_path / "cli.err", "w") as err:
        p = subprocess.Popen([sys.executable, "-c", CLI_WRAPPER, "serve", "--model", str(model), "--port", "0",
                              "--run-dir", str(run), *extra], stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert p.stdout is not None
    assert "pdserve is serving" in p.stdout.readline(), (tmp_path / "cli.err").read_text()
    return p, run


def _pids(run: Path) -> dict[str, int]:
    m = json.loads((run / "launch.json").read_text())
    return {**{w["name"]: w["pid"] for w in m["workers"]}, "router": m["router"]["pid"]}


def test_cli_crash_loop_is_given_up_the_rest_serves_and_sigterm_restarts_nothing(fakes, tmp_path):
    flag = tmp_path / "fail"
    p, run = _start_cli(fakes, tmp_path, "--colocated", "2", "--restart-backoff", "0.1", "--restart-backoff-max",
                        "0.2", "--crash-loop-restarts", "2", "--worker-args", f"--fail-if {flag}")
    err = tmp_path / "cli.err"
    try:
        first = _pids(run)
        # the router is restarted too, on its port
        os.kill(first["router"], signal.SIGKILL)
        _until(lambda: _pids(run)["router"] != first["router"], what="the router restarted")
        url = json.loads((run / "launch.json").read_text())["router_url"]
        _until(lambda: http_status(url + "/health") == 200, what="the router back")
        # colocated1 now fails at every start: 2 restarts, then given up; colocated0 and the router go on
        flag.touch()
        os.kill(first["colocated1"], signal.SIGKILL)
        _until(lambda: "crash loop: 2 restarts within 600 s: giving it up" in err.read_text(), what="the give-up")
        assert (run / "colocated1.log.1").read_text() == "boom: cannot start\n"
        assert p.poll() is None and pid_alive(first["colocated0"])
        m = json.loads((run / "launch.json").read_text())
        assert _metric(m["metrics_url"], "pdserve_process_crash_loop", "colocated1") == 1
        assert _metric(m["metrics_url"], "pdserve_process_restarts_total", "colocated1") == 2
        assert _metric(m["metrics_url"], "pdserve_process_restarts_total", "router") == 1
        # an orderly stop: every process ends, none is restarted meanwhile
        flag.unlink()
        pids = list(_pids(run).values())
        mark = len(err.read_text())
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        after = err.read_text()[mark:]
        assert "got SIGTERM" in after and "restart" not in after, after
        assert "ignored SIGTERM" not in after, after  # restarted children do not inherit the held signals
        assert wait_dead(pids, 10) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        assert p.stdout is not None
        p.stdout.close()


def test_cli_ends_when_every_worker_is_given_up(fakes, tmp_path):
    flag = tmp_path / "fail"
    p, run = _start_cli(fakes, tmp_path, "--colocated", "1", "--restart-backoff", "0.1", "--crash-loop-restarts",
                        "1", "--worker-args", f"--fail-if {flag}")
    try:
        flag.touch()
        pids = list(_pids(run).values())
        os.kill(_pids(run)["colocated0"], signal.SIGKILL)
        assert p.wait(timeout=30) == 1
        assert "every worker exited and none is restarted; stopping" in (tmp_path / "cli.err").read_text()
        assert wait_dead(pids, 10) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        assert p.stdout is not None
        p.stdout.close()
