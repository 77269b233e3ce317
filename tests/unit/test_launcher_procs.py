"""Process management without vLLM: process groups, SIGTERM -> SIGKILL, the reaper after kill -9, health waits,
and the whole Cluster / `pdserve serve` lifecycle with a fake worker and router (tiny HTTP servers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdserve import launch as launcher
from pdserve.http_probe import PID_HEADER, http_status
from pdserve.launch import commands
from pdserve.launch.config import LauncherConfig
from pdserve.launch.procs import (
    LaunchError,
    Reaper,
    group_alive,
    pid_alive,
    pids_in_group,
    spawn,
    spawn_healthy,
    stop_children,
    wait_dead,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]

FAKE_SERVER = r'''
"""Stands in for the vLLM server and the router: prints what it got, optionally forks a grandchild, fails,
ignores SIGTERM or answers /health after a delay."""
import argparse, http.server, json, os, signal, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--fake-delay", type=float, default=0.0)
p.add_argument("--fake-fail", action="store_true")
p.add_argument("--fake-grandchild", action="store_true")
p.add_argument("--fake-ignore-term", action="store_true")
a, rest = p.parse_known_args()
print("ARGV", json.dumps(sys.argv), flush=True)
print("ENV", json.dumps({k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
      "PDSERVE_TRANSFER_SECRET", "PDSERVE_WORKER_NAME")}), flush=True)
if a.fake_ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if a.fake_grandchild:
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("GRANDCHILD", g.pid, flush=True)
if a.fake_fail:
    print("boom: fake failure for the test", flush=True)
    sys.exit(3)
time.sleep(a.fake_delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("SERVING", a.port, time.time(), flush=True)
http.server.HTTPServer((a.host, a.port), H).serve_forever()
'''


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    """Make the launcher start tests' fake_server module instead of vLLM and the router."""
    mod_dir = tmp_path / "fakemods"
    mod_dir.mkdir()
    (mod_dir / "fake_server.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(mod_dir))
    monkeypatch.setattr(commands, "VLLM_SERVER_MODULE", "fake_server")
    monkeypatch.setattr(commands, "ROUTER_MODULE", "fake_server")
    return mod_dir


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _sleeper_argv(grandchild: bool = True, ignore_term: bool = False) -> list[str]:
    code = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        if {ignore_term}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if {grandchild}:
            g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print("GRANDCHILD", g.pid, flush=True)
        print("READY", flush=True)
        time.sleep(600)
    """)
    return [sys.executable, "-c", code]


def _wait_for_line(path: Path, prefix: str, timeout: float = 20.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.startswith(prefix):
                    return line
        time.sleep(0.05)
    raise AssertionError(f"{prefix!r} never appeared in {path}: {path.read_text() if path.exists() else ''}")





# ----------------------------------------------------------------- groups and signals

def test_child_gets_own_group_and_stop_kills_grandchildren(tmp_path):
    log = tmp_path / "c.log"
    c = spawn("c", _sleeper_argv(), env=dict(os.environ), log_path=log)
    g = int(_wait_for_line(log, "GRANDCHILD").split()[1])
    assert os.getpgid(c.pid) == c.pid != os.getpgid(0)
    assert set(pids_in_group(c.pgid)) == {c.pid, g}
    t0 = time.monotonic()
    assert stop_children([c], timeout_s=5) == []
    assert time.monotonic() - t0 < 5
    assert not c.alive() and not group_alive(c.pgid) and wait_dead([g]) == []


def test_sigterm_ignored_escalates_to_sigkill(tmp_path):
    log = tmp_path / "c.log"
    c = spawn("stubborn", _sleeper_argv(grandchild=False, ignore_term=True), env=dict(os.environ), log_path=log)
    _wait_for_line(log, "READY")
    t0 = time.monotonic()
    assert stop_children([c], timeout_s=0.5) == ["stubborn"]
    assert 0.4 < time.monotonic() - t0 < 5
    assert c.proc.returncode == -signal.SIGKILL


FAKE_LAUNCHER = r'''
import os, sys, threading, time
from pathlib import Path
from pdserve.launch.procs import Reaper, spawn
reaper = Reaper()
argv = [sys.executable, "-c", "import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(600)']); print('GRANDCHILD', g.pid, flush=True); time.sleep(600)"]
log = Path(sys.argv[1])
if sys.argv[2] == "thread":  # spawned from a non-main thread: no PDEATHSIG, the reaper alone must clean up
    out = []
    t = threading.Thread(target=lambda: out.append(spawn("c", argv, dict(os.environ), log, reaper=reaper)))
    t.start(); t.join()
    c = out[0]
else:
    c = spawn("c", argv, dict(os.environ), log, reaper=reaper)
print(c.pid, reaper.proc.pid, flush=True)
time.sleep(600)
'''


@pytest.mark.parametrize("where", ["main", "thread"])
def test_kill_9_of_launcher_leaves_no_orphans(tmp_path, where):
    log = tmp_path / "c.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    fake = subprocess.Popen([sys.executable, "-c", FAKE_LAUNCHER, str(log), where], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        child, reaper = map(int, fake.stdout.readline().split())
        g = int(_wait_for_line(log, "GRANDCHILD").split()[1])
        assert all(pid_alive(p) for p in (child, g, reaper))
    finally:
        fake.kill()
        fake.wait()
        fake.stdout.close()
    assert wait_dead([child, g, reaper]) == []


def test_reaper_clean_goodbye_kills_nothing(tmp_path):
    log = tmp_path / "c.log"
    r = Reaper()
    c = spawn("c", _sleeper_argv(grandchild=False), env=dict(os.environ), log_path=log, reaper=r)
    _wait_for_line(log, "READY")
    r.close()
    time.sleep(0.2)
    assert c.alive()
    stop_children([c], timeout_s=5)


# ----------------------------------------------------------------- health waits

def test_wait_healthy_reports_exit_with_log_tail(tmp_path):
    log = tmp_path / "w.log"
    c = spawn("w", [sys.executable, "-c", "print('line one'); print('Error: the reason'); raise SystemExit(7)"],
              env=dict(os.environ), log_path=log)
    c.url = "http://127.0.0.1:9"
    with pytest.raises(LaunchError, match=r"(?s)w exited with code 7.*Error: the reason"):
        wait_healthy([c], timeout_s=30, poll_s=0.05)
    c = spawn("w2", [sys.executable, "-c", "print('OSError: [Errno 98] Address already in use'); raise SystemExit(1)"],
              env=dict(os.environ), log_path=tmp_path / "w2.log")
    c.url = "http://127.0.0.1:9"
    with pytest.raises(LaunchError, match=r"Another process took http://127.0.0.1:9 .*run again"):
        wait_healthy([c], timeout_s=30, poll_s=0.05)


def test_wait_healthy_timeout_names_worker_and_shows_log(tmp_path):
    log = tmp_path / "w.log"
    c = spawn("slow", _sleeper_argv(grandchild=False), env=dict(os.environ), log_path=log)
    c.url = "http://127.0.0.1:9"
    try:
        _wait_for_line(log, "READY")
        with pytest.raises(LaunchError, match=r"(?s)timed out after 0.5 s waiting for slow.*READY"):
            wait_healthy([c], timeout_s=0.5, poll_s=0.05)
    finally:
        stop_children([c], timeout_s=5)


def test_wait_healthy_counts_a_shared_port_ready_per_process_that_answered(tmp_path):
    """Router replicas share one port: a 200 counts only for the replica whose pid answered it."""
    import http.server
    import itertools
    import threading

    kids = [spawn(f"r{i}", _sleeper_argv(grandchild=False), env=dict(os.environ), log_path=tmp_path / f"r{i}.log")
            for i in range(2)]
    answering = itertools.cycle([kids[0].pid])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header(PID_HEADER, str(next(answering)))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for k in kids:
            k.url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(LaunchError, match="waiting for r1 to answer"):  # only r0 ever answered
            wait_healthy(kids, timeout_s=1.0, poll_s=0.05)
        assert kids[0].ready_at is not None and kids[1].ready_at is None
        answering = itertools.cycle([kids[0].pid, kids[1].pid])
        wait_healthy(kids, timeout_s=5.0, poll_s=0.05)
        assert kids[1].ready_at is not None
    finally:
        server.shutdown()
        stop_children(kids, timeout_s=5)


def test_spawn_healthy_returns_the_serving_child_and_stops_one_that_fails(tmp_path):
    from pdserve.launch.procs import free_port

    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    port = free_port()
    argv = [sys.executable, str(tmp_path / "fake_server.py"), "--port", str(port), "--fake-delay", "0.3"]
    c = spawn_healthy("srv", argv, f"http://127.0.0.1:{port}", 30, env=dict(os.environ), log_path=tmp_path / "a.log")
    try:
        assert c.ready_at is not None and http_status(c.url + "/health") == 200
    finally:
        stop_children([c], timeout_s=5)
    with pytest.raises(LaunchError, match=r"(?s)bad exited with code 3.*boom"):
        spawn_healthy("bad", [*argv, "--fake-fail"], f"http://127.0.0.1:{port}", 30, env=dict(os.environ),
                      log_path=tmp_path / "b.log")
    log = tmp_path / "c.log"  # never healthy: stopped, its whole group with it, when the time is up
    with pytest.raises(LaunchError, match=r"timed out after 5 s waiting for slow"):
        spawn_healthy("slow", _sleeper_argv(), "http://127.0.0.1:9", 5, env=dict(os.environ), log_path=log)
    grandchild = int(_wait_for_line(log, "GRANDCHILD").split()[1])
    assert wait_dead([grandchild], 10) == []


# ----------------------------------------------------------------- Cluster with fakes

def _log_json(path: Path, prefix: str) -> dict:
    return json.loads(_wait_for_line(path, prefix).split(" ", 1)[1])


def test_cluster_pd_lifecycle(fake_modules, model_dir, tmp_path):
    cfg = LauncherConfig(model=str(model_dir), prefill=1, decode=2, port=0, cores=(0, 1), kv_cache_gib=2, pool=False,
                         run_dir=str(tmp_path / "run"), worker_args=("--fake-delay", "0.5"),
                         router_args=("--fake-grandchild",), stop_timeout_s=5)
    lines = []
    with launcher.Cluster(cfg, log=lines.append) as c:
        assert [w.name for w in c.workers] == ["prefill0", "decode0", "decode1"]
        assert c.router is not None and all(w.ready_at <= c.router.ready_at for w in c.workers)
        assert http_status(c.router_url + "/health") == 200
        assert c.worker_urls("decode") == [c.workers[1].url, c.workers[2].url]
        assert c.model_name == "tiny"
        envs = [_log_json(w.log_path, "ENV") for w in c.workers]
        assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == ["0", "1", "0"]
        assert {e["VLLM_CPU_KVCACHE_SPACE"] for e in envs} == {"2"}
        assert {e["PDSERVE_TRANSFER_SECRET"] for e in envs} == {c.secret} and len(c.secret) >= 32
        assert _log_json(c.router.log_path, "ENV")["PDSERVE_TRANSFER_SECRET"] is None
        router_argv = _log_json(c.router.log_path, "ARGV")
        assert router_argv[router_argv.index("--decode") + 1:router_argv.index("--decode") + 3] == c.worker_urls(
            "decode")
        manifest = json.loads((tmp_path / "run" / "launch.json").read_text())
        assert [w["pid"] for w in manifest["workers"]] == [w.pid for w in c.workers]
        assert manifest["router"]["pid"] == c.router.pid and c.secret not in json.dumps(manifest)
        grandchild = int(_wait_for_line(c.router.log_path, "GRANDCHILD").split()[1])
        pids = [w.pid for w in c.children()] + [grandchild]
        pgids = c.pgids()
    assert wait_dead(pids) == []
    assert not any(group_alive(g) for g in pgids)
    assert any("router ready" in line for line in lines)
    assert any(line.startswith("stopped 4 process group(s)") for line in lines), lines


def test_cluster_worker_failure_shows_log_and_cleans_up(fake_modules, model_dir, tmp_path, monkeypatch):
    from pdserve.launch import plan as launch_plan

    cfg = LauncherConfig(model=str(model_dir), colocated=2, port=0, run_dir=str(tmp_path / "run"),
                         worker_args=("--fake-delay", "30", "--fake-grandchild"), stop_timeout_s=5)
    c = launcher.Cluster(cfg)
    # make the second worker fail: give it the flag through its own (planned) args after planning
    orig = launch_plan.plan_workers

    def plan(*a, **k):
        ws = orig(*a, **k)
        from dataclasses import replace

        return [ws[0], replace(ws[1], extra_args=ws[1].extra_args + ("--fake-fail",))]

    monkeypatch.setattr(launch_plan, "plan_workers", plan)
    with pytest.raises(LaunchError, match=r"(?s)colocated1 exited with code 3.*boom: fake failure"):
        c.start()
    g = int(_wait_for_line(c.workers[0].log_path, "GRANDCHILD").split()[1])
    assert wait_dead([w.pid for w in c.children()] + [g]) == []


def test_cluster_router_failure_during_worker_load_fails_fast(fake_modules, model_dir, tmp_path):
    cfg = LauncherConfig(model=str(model_dir), colocated=1, port=0, run_dir=str(tmp_path / "run"),
                         worker_args=("--fake-delay", "60"), router_args=("--fake-fail",), stop_timeout_s=5)
    c = launcher.Cluster(cfg)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)router exited with code 3 during start-up.*boom"):
        c.start()
    assert time.monotonic() - t0 < 20
    assert wait_dead([w.pid for w in c.children()]) == []


def test_cluster_router_port_in_use(fake_modules, model_dir, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = LauncherConfig(model=str(model_dir), colocated=1, port=s.getsockname()[1], run_dir=str(tmp_path))
        with pytest.raises(LaunchError, match="in use.*--port 0"):
            launcher.Cluster(cfg).start()


# ----------------------------------------------------------------- `pdserve serve` with fakes

CLI_WRAPPER = r'''
import sys
import pdserve.launch.commands as L
L.VLLM_SERVER_MODULE = L.ROUTER_MODULE = "fake_server"
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
'''


def _start_cli(fake_modules, model_dir, run_dir, *extra):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{fake_modules}")
    err = open(run_dir.parent / "cli.err", "w")
    p = subprocess.Popen(
        [sys.executable, "-c", CLI_WRAPPER, "serve", "--model", str(model_dir), "--port", "0", "--run-dir",
         str(run_dir), "--worker-args", "--fake-delay 0.3 --fake-grandchild", *extra],
        stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    err.close()
    banner = p.stdout.readline()
    assert "pdserve is serving tiny at http://127.0.0.1:" in banner, (run_dir.parent / "cli.err").read_text()
    manifest = json.loads((run_dir / "launch.json").read_text())
    pids = [w["pid"] for w in manifest["workers"]] + [manifest["router"]["pid"]]
    pids += [int(_wait_for_line(Path(w["log"]), "GRANDCHILD").split()[1]) for w in manifest["workers"]]
    return p, pids, banner


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_signal_stops_everything(fake_modules, model_dir, tmp_path, sig):
    p, pids, _ = _start_cli(fake_modules, model_dir, tmp_path / "run")
    p.send_signal(sig)
    out = p.stdout.read()  # the banner goes on with curl and OpenAI client snippets
    p.stdout.close()
    assert p.wait(timeout=30) == 0
    err = (tmp_path / "cli.err").read_text()
    assert "curl http://127.0.0.1:" in out and "OpenAI(base_url=" in out
    assert "stopped" in err and "got SIG" in err
    assert wait_dead(pids) == []


def test_cli_kill_9_leaves_no_orphans(fake_modules, model_dir, tmp_path):
    p, pids, _ = _start_cli(fake_modules, model_dir, tmp_path / "run", "--colocated", "1")
    p.kill()
    p.wait()
    p.stdout.close()
    assert wait_dead(pids) == []
