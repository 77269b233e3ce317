"""pdserve.launch.warm_start: processes forked from a warm starter act like executed ones (argv, env, folder, log, exit
code, own session), end when the launcher's pipe closes, and a starter that cannot import falls back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.launch import procs, warm_start

ROOT = Path(__file__).resolve().parents[2]
CHILD = "tests.unit.warm_child"


@pytest.fixture(scope="module")
def starter():
    s = warm_start.WarmStarter(("json",))
    yield s
    s.close()


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", CHILD, *args]


def _said(log: Path, timeout_s: float = 20.0) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        text = log.read_text() if log.exists() else ""
        if text.endswith("\n"):
            return json.loads(text.splitlines()[0])
        time.sleep(0.05)
    raise AssertionError(f"the child wrote nothing to {log}")


def test_a_forked_process_gets_its_argv_env_folder_log_and_session(starter, tmp_path):
    log = tmp_path / "child.log"
    p = starter.spawn(_argv("3", "x"), dict(os.environ, WARM_TEST="yes"), str(ROOT), str(log))
    assert p.wait(timeout=20) == 3 and p.poll() == 3 and p.returncode == 3
    said = _said(log)
    assert said["argv"] == ["3", "x"] and said["env"] == "yes" and said["cwd"] == str(ROOT)
    assert said["name"] == "__main__" and said["pid"] == p.pid and said["pgid"] == p.pid and said["stdin"] == ""


def test_a_killed_process_reports_the_signal_and_wait_times_out_while_it_runs(starter, tmp_path):
    p = starter.spawn(_argv("sleep"), dict(os.environ), str(ROOT), str(tmp_path / "child.log"))
    _said(tmp_path / "child.log")
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    p.kill()
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert not procs.pid_alive(p.pid)


def test_closing_the_starter_kills_what_it_still_runs(tmp_path):
    s = warm_start.WarmStarter(("json",))
    p = s.spawn(_argv("sleep"), dict(os.environ), str(ROOT), str(tmp_path / "child.log"))
    _said(tmp_path / "child.log")
    s.close()
    assert procs.wait_dead([p.pid], timeout_s=10) == []
    assert s.proc.returncode == 0 and p.poll() == -signal.SIGKILL


def test_a_starter_that_cannot_import_is_refused_and_spawn_executes_instead(monkeypatch, tmp_path):
    with pytest.raises(warm_start.WarmStartError, match="no_such_module"):
        warm_start.WarmStarter(("no_such_module",))
    monkeypatch.setattr(warm_start, "PRELOAD", ("no_such_module",))
    monkeypatch.setattr(warm_start, "WARM_MODULES", (CHILD,))
    monkeypatch.setenv(warm_start.ENV, "1")
    monkeypatch.setattr(warm_start, "_STARTER", [])  # not this test process's own starter (a stack may use it)
    child = procs.spawn("c", _argv("0"), log_path=tmp_path / "c.log", cwd=ROOT)
    assert isinstance(child.proc, subprocess.Popen) and child.proc.wait(timeout=20) == 0
    assert warm_start._STARTER == [None]


def test_only_python_dash_m_of_a_warm_module_is_forked():
    vllm = warm_start.WARM_MODULES[0]
    assert warm_start.module_of([sys.executable, "-m", vllm, "--port", "1"]) == vllm
    assert warm_start.module_of(["/other/python", "-m", vllm]) is None
    assert warm_start.module_of([sys.executable, "-m", "pdserve.store.cli"]) is None
    assert warm_start.module_of([sys.executable, "-c", "pass"]) is None
    in_ns = ["ip", "netns", "exec", "pd-p", sys.executable, "-m", vllm, "--port", "1"]
    assert warm_start.module_of(in_ns) == vllm
    assert warm_start.split_netns(in_ns) == ("pd-p", in_ns[4:])
    assert warm_start.split_netns(["ip", "netns", "list"]) == (None, ["ip", "netns", "list"])


def test_a_forked_process_takes_its_openmp_settings_as_an_executed_one_would(tmp_path):
    """The warm starter's torch read OpenMP's variables before the request's environment existed: the child applies
    the launcher's OMP_NUM_THREADS (torch's thread count) and OMP_PLACES with OMP_PROC_BIND (its CPU affinity)."""
    s = warm_start.WarmStarter(("torch",))
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", OMP_PLACES="{0}", OMP_PROC_BIND="true")
        p = s.spawn(_argv("0"), env, str(ROOT), str(tmp_path / "child.log"))
        assert p.wait(timeout=30) == 0
        said = _said(tmp_path / "child.log")
        assert said["affinity"] == [0] and said["threads"] == 1, said
        plain = dict(os.environ)
        for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"):
            plain.pop(k, None)
        p = s.spawn(_argv("0"), plain, str(ROOT), str(tmp_path / "plain.log"))
        assert p.wait(timeout=30) == 0
        assert _said(tmp_path / "plain.log")["affinity"] == sorted(os.sched_getaffinity(0))  # left as inherited
    finally:
        s.close()


@pytest.mark.parametrize("env, cores", [
    ({"OMP_PLACES": "{0,2,3}", "OMP_PROC_BIND": "true"}, (0, 2, 3)),
    ({"OMP_PLACES": "{1}", "OMP_PROC_BIND": "close"}, (1,)),
    ({"OMP_PLACES": "{0,1}"}, None),  # not bound
    ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, None),  # an abstract name: the runtime's business
    ({"OMP_PLACES": "{0:4}", "OMP_PROC_BIND": "true"}, None),  # an interval: not what the launcher writes
    ({}, None),
])
def test_openmp_places_reads_the_launchers_lists_of_cores_only(env, cores):
    assert warm_start.openmp_places(env) == cores
