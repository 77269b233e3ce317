"""pdserve.launch.supervisor: backoff, reset, crash-loop give-up and metrics with a fake clock; rotate_log; the
supervision settings (config and flags); and the supervisor over real child processes that crash."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli import build_parser, config_from_args
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.launch.procs import Child, rotate_log, spawn
from pdserve.launch.supervisor import (
    BACKOFF,
    GIVEN_UP,
    STARTING,
    UP,
    RestartPolicy,
    RestartTracker,
    Supervisor,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeProc:
    """Enough of subprocess.Popen for Child: poll() and returncode."""

    _next_pid = 100

    def __init__(self) -> None:
        FakeProc._next_pid += 1
        self.pid = FakeProc._next_pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def fake_child(name: str) -> Child:
    return Child(name=name, proc=FakeProc(), log_path=None, argv=[name])  # type: ignore[arg-type]


def delays(tracker: RestartTracker, clock: Clock, n: int, gap: float = 0.0) -> list[float | None]:
    """Exit ``n`` times in a row (restarting after each delay, then running ``gap`` s); the delays, None = gave up."""
    out: list[float | None] = []
    for _ in range(n):
        d = tracker.exited(clock.t)
        if not d.restart:
            out.append(None)
            break
        out.append(d.delay_s)
        clock.t += d.delay_s
        tracker.restarted(clock.t)
        clock.t += gap
    return out


# --------------------------------------------------------------------------- the policy, pure


def test_backoff_doubles_from_1_s_up_to_30_s():
    clock = Clock()
    t = RestartTracker(RestartPolicy(loop_restarts=100))
    assert delays(t, clock, 8) == [1, 2, 4, 8, 16, 30, 30, 30]


def test_backoff_resets_after_5_minutes_healthy_and_not_before():
    clock = Clock()
    t = RestartTracker(RestartPolicy(loop_restarts=100, loop_window_s=1))
    assert delays(t, clock, 3) == [1, 2, 4]
    t.healthy(clock.t)
    clock.t += 299.0
    assert t.exited(clock.t).delay_s == 8  # 299 s healthy: the streak goes on
    t.restarted(clock.t)
    t.healthy(clock.t)
    clock.t += 300.0
    assert t.exited(clock.t).delay_s == 1  # 300 s healthy: it starts over
    # time alive without ever being healthy (stuck loading) does not reset the streak
    t.restarted(clock.t)
    clock.t += 1000.0
    assert t.exited(clock.t).delay_s == 2


def test_crash_loop_gives_up_after_n_restarts_within_the_window():
    clock = Clock()
    t = RestartTracker(RestartPolicy(loop_restarts=5, loop_window_s=600))
    assert delays(t, clock, 7) == [1, 2, 4, 8, 16, None]
    d = t.exited(clock.t)
    assert not d.restart and d.reason == "crash loop: 5 restarts within 600 s"


def test_restarts_older_than_the_window_do_not_count_towards_a_crash_loop():
    clock = Clock()
    t = RestartTracker(RestartPolicy(loop_restarts=2, loop_window_s=60, backoff_max_s=1))
    assert delays(t, clock, 2, gap=20.0) == [1, 1]  # restarts at t+1 and t+22
    clock.t += 30.0  # t+72: the first restart is 71 s old, the second 50 s
    assert t.exited(clock.t).restart
    t.restarted(clock.t)
    assert not t.exited(clock.t + 1).restart  # two restarts within 60 s


def test_restarts_off_gives_up_at_the_first_exit():
    d = RestartTracker(RestartPolicy(enabled=False)).exited(0.0)
    assert not d.restart and "--no-restart" in d.reason


def test_policy_from_config():
    cfg = LauncherConfig(colocated=1, restart_backoff_s=0.5, restart_backoff_max_s=4, restart_reset_s=10,
                         crash_loop_restarts=3, crash_loop_window_s=20, restart=False)
    assert RestartPolicy.from_config(cfg) == RestartPolicy(0.5, 4, 10, 3, 20, False)
    assert RestartPolicy.from_config(LauncherConfig(colocated=1)) == RestartPolicy(1.0, 30.0, 300.0, 5, 600.0)


# --------------------------------------------------------------------------- the supervisor, fake processes


def metric(sup: Supervisor, name: str, process: str) -> float | None:
    return sup.metrics.registry.get_sample_value(name, {"process": process})


def make_supervisor(clock: Clock, healthy: set[str], **policy) -> tuple[Supervisor, list[str], list[Child]]:
    log: list[str] = []
    spawned: list[Child] = []

    def respawn(old: Child) -> Child:
        new = fake_child(old.name)
        spawned.append(new)
        return new

    sup = Supervisor(RestartPolicy(**policy), respawn, probe=lambda c: c.name in healthy, log=log.append,
                     clock=clock)
    return sup, log, spawned


def test_supervisor_restarts_after_the_backoff_and_sees_the_process_healthy_again():
    clock = Clock()
    healthy: set[str] = set()
    sup, log, spawned = make_supervisor(clock, healthy)
    d, p = fake_child("decode0"), fake_child("prefill0")
    sup.watch(d)
    sup.watch(p)
    assert metric(sup, "pdserve_process_up", "decode0") == 1
    assert metric(sup, "pdserve_process_restarts_total", "decode0") == 0
    d.proc.returncode = -9
    sup.step()
    assert sup.state("decode0") == BACKOFF and sup.state("prefill0") == UP
    assert "decode0 (pid" in log[-1] and "exited with code -9; restarting in 1 s" in log[-1]
    assert metric(sup, "pdserve_process_up", "decode0") == 0
    assert metric(sup, "pdserve_process_exits_total", "decode0") == 1
    clock.t += 0.9
    sup.step()
    assert spawned == []
    clock.t += 0.1
    sup.step()
    assert len(spawned) == 1 and sup.procs["decode0"].child is spawned[0]
    assert sup.state("decode0") == STARTING
    assert metric(sup, "pdserve_process_restarts_total", "decode0") == 1
    clock.t += 30
    sup.step()
    assert sup.state("decode0") == STARTING  # not healthy yet (loading the model)
    healthy.add("decode0")
    sup.step()
    assert sup.state("decode0") == UP and metric(sup, "pdserve_process_up", "decode0") == 1
    assert log[-1] == "decode0 is healthy again, 31.0 s after it exited"
    # it crashes again before it was healthy for 5 minutes: the next wait is 2 s
    spawned[0].proc.returncode = 1
    sup.step()
    assert "restarting in 2 s" in log[-1]


def test_supervisor_gives_up_a_crash_loop_and_keeps_the_rest():
    clock = Clock()
    sup, log, spawned = make_supervisor(clock, set(), loop_restarts=2, loop_window_s=60)
    node, router = fake_child("pool-node"), fake_child("router")
    sup.watch(node)
    sup.watch(router)
    for _ in range(3):
        sup.procs["pool-node"].child.proc.returncode = 3
        sup.step()  # exit seen
        clock.t += 10
        sup.step()  # restart (or nothing once given up)
    assert sup.state("pool-node") == GIVEN_UP and sup.given_up() == ["pool-node"]
    assert len(spawned) == 2
    assert "crash loop: 2 restarts within 60 s: giving it up" in log[-1]
    assert metric(sup, "pdserve_process_crash_loop", "pool-node") == 1
    assert metric(sup, "pdserve_process_crash_loop", "router") == 0
    assert metric(sup, "pdserve_process_restarts_total", "pool-node") == 2
    assert sup.state("router") == UP
    clock.t += 1000
    sup.step()
    assert len(spawned) == 2  # given up means given up


def test_closed_supervisor_restarts_nothing():
    clock = Clock()
    sup, log, spawned = make_supervisor(clock, set())
    w = fake_child("decode0")
    sup.watch(w)
    sup.close()
    w.proc.returncode = -15
    for _ in range(3):
        clock.t += 60
        sup.step()
    assert spawned == [] and log == []


def test_a_failed_respawn_counts_as_an_exit_of_the_streak():
    clock = Clock()
    log: list[str] = []

    def respawn(old: Child) -> Child:
        raise OSError("no such file")

    sup = Supervisor(RestartPolicy(loop_restarts=2), respawn, probe=lambda c: True, log=log.append, clock=clock)
    w = fake_child("router")
    sup.watch(w)
    w.proc.returncode = 1
    sup.step()
    clock.t += 1
    sup.step()
    assert "restarting router failed: no such file" in log[-1] and sup.state("router") == BACKOFF
    assert sup.procs["router"].restart_at == clock.t + 2
    clock.t += 2
    sup.step()
    assert sup.state("router") == GIVEN_UP


# --------------------------------------------------------------------------- logs


def test_rotate_log_keeps_the_last_crashes(tmp_path: Path):
    log = tmp_path / "decode0.log"
    assert rotate_log(log) is None
    for i in range(7):
        log.write_text(f"start {i}")
        assert rotate_log(log, keep=3) == tmp_path / "decode0.log.1"
        assert not log.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode0.log.1", "decode0.log.2", "decode0.log.3"]
    assert [(tmp_path / f"decode0.log.{k}").read_text() for k in (1, 2, 3)] == ["start 6", "start 5", "start 4"]


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(("kw", "match"), [
    ({"restart_backoff_s": 0}, "restart_backoff_s=0: use a positive number of seconds"),
    ({"restart_backoff_s": 5, "restart_backoff_max_s": 2}, "the cap must be at least the first wait"),
    ({"restart_reset_s": -1}, "restart_reset_s=-1"),
    ({"crash_loop_restarts": 0}, "crash_loop_restarts=0: use a whole number >= 1"),
    ({"crash_loop_window_s": "x"}, "crash_loop_window_s='x'"),
    ({"restart": "yes"}, "restart='yes': use true"),
    ({"metrics_port": 70000}, "metrics_port=70000"),
])
def test_supervision_settings_are_validated(kw, match):
    with pytest.raises(ConfigError, match=match):
        LauncherConfig(colocated=1, **kw)


def test_serve_flags_set_the_supervision_settings():
    args = build_parser().parse_args(["serve", "--colocated", "1", "--no-restart", "--restart-backoff", "0.5",
                                      "--restart-backoff-max", "8", "--restart-reset", "60",
                                      "--crash-loop-restarts", "3", "--crash-loop-window", "120",
                                      "--metrics-port", "9100"])
    cfg = config_from_args(args)
    assert (cfg.restart, cfg.restart_backoff_s, cfg.restart_backoff_max_s, cfg.restart_reset_s,
            cfg.crash_loop_restarts, cfg.crash_loop_window_s, cfg.metrics_port) == (False, 0.5, 8, 60, 3, 120, 9100)
    assert config_from_args(build_parser().parse_args(["serve", "--colocated", "1"])).restart is True


# --------------------------------------------------------------------------- real processes


def test_real_crashing_child_is_given_up_and_a_killed_one_restarted(tmp_path: Path):
    """Real child processes: one exits at once every start (crash loop, given up after 3 restarts, each crash's
    log kept), one is kill -9'd and restarted; a sleeper stays up throughout."""
    argv = {
        "crasher": [sys.executable, "-c", "import sys; print('boom', flush=True); sys.exit(3)"],
        "victim": [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        "bystander": [sys.executable, "-c", "import time; time.sleep(60)"],
    }
    starts = {n: 0 for n in argv}

    def start(name: str) -> Child:
        starts[name] += 1
        return spawn(name, argv[name], log_path=tmp_path / f"{name}.log")

    log: list[str] = []
    sup = Supervisor(RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, loop_restarts=3, loop_window_s=30),
                     respawn=lambda old: (rotate_log(old.log_path), start(old.name))[1],
                     probe=lambda c: c.alive(), log=log.append)
    children = {n: start(n) for n in argv}
    try:
        for c in children.values():
            sup.watch(c)
        victim_pid = children["victim"].pid
        subprocess.run(["kill", "-9", str(victim_pid)], check=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sup.step()
            if sup.state("crasher") == GIVEN_UP and sup.state("victim") == UP and starts["victim"] == 2:
                break
            time.sleep(0.02)
        assert sup.state("crasher") == GIVEN_UP, log
        assert starts["crasher"] == 4  # the first start and 3 restarts
        assert sup.state("victim") == UP and sup.procs["victim"].child.pid != victim_pid
        assert sup.state("bystander") == UP and starts["bystander"] == 1
        assert sup.metrics.registry.get_sample_value("pdserve_process_restarts_total", {"process": "victim"}) == 1
        assert sup.metrics.registry.get_sample_value("pdserve_process_crash_loop", {"process": "crasher"}) == 1
        kept = sorted(p.name for p in tmp_path.glob("crasher.log*"))
        assert kept == ["crasher.log", "crasher.log.1", "crasher.log.2", "crasher.log.3"]
        assert all((tmp_path / k).read_text() == "boom\n" for k in kept)
    finally:
        sup.close()
        for s in sup.procs.values():
            if s.child.alive():
                s.child.proc.kill()
            s.child.proc.wait(timeout=10)
