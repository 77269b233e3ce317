"""Supervision: restart any process of a launch that exits, with backoff, crash-loop give-up and metrics.

    sup = Supervisor(RestartPolicy.from_config(cfg), respawn=cluster.respawn, probe=cluster.probe, log=print)
    sup.watch(child)           # every process, once the launch is up
    while running:
        sup.step()             # detect exits, restart what is due, notice restarted processes becoming healthy
        time.sleep(0.5)
    sup.close()                # orderly shutdown: no restart from now on

Per process (:class:`RestartTracker`, pure, driven by a clock passed in):

- the k-th exit in a row is restarted after ``min(backoff_s * 2**(k-1), backoff_max_s)`` seconds (1, 2, 4, ...,
  30 s by default);
- the count of exits in a row goes back to 0 once the process has been healthy for ``reset_s`` (5 minutes);
- a process that exits when it was already restarted ``loop_restarts`` times within the last ``loop_window_s``
  is in a crash loop: it is reported (a log line, ``pdserve_process_crash_loop{process}`` = 1) and given up,
  while the rest of the launch keeps serving.

A restarted process gets the same argv, so the same port: the router, which probes its workers' health, takes
a restarted worker back as soon as its ``/health`` answers 200. The crash's log is kept (the cluster rotates it
to ``NAME.log.1`` before the restart). Restarts and exits are counted in :class:`SupervisorMetrics`, served by
the launcher on its own metrics port.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from .procs import Child

STARTING, UP, BACKOFF, GIVEN_UP = "starting", "up", "backoff", "given_up"


@dataclass(frozen=True)
class RestartPolicy:
    """backoff_s: wait before the first restart of a streak; doubled per exit in a row up to backoff_max_s.
    reset_s: healthy this long and the streak starts over. loop_restarts / loop_window_s: that many restarts
    within the window and the next exit gives the process up."""

    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    reset_s: float = 300.0
    loop_restarts: int = 5
    loop_window_s: float = 600.0
    enabled: bool = True  # False: report exits, restart nothing (pdserve serve --no-restart)

    @classmethod
    def from_config(cls, config: Any) -> RestartPolicy:
        """From a :class:`~pdserve.launch.config.LauncherConfig` (which validated the values)."""
        return cls(config.restart_backoff_s, config.restart_backoff_max_s, config.restart_reset_s,
                   config.crash_loop_restarts, config.crash_loop_window_s, config.restart)


@dataclass(frozen=True)
class Decision:
    """What to do about one exit: restart after ``delay_s``, or give up (``reason`` says why)."""

    restart: bool
    delay_s: float = 0.0
    reason: str = ""


@dataclass
class RestartTracker:
    """One process's restart history. Pure: every time is passed in."""

    policy: RestartPolicy
    streak: int = 0  # exits in a row (not separated by reset_s of health)
    healthy_since: float | None = None
    restarts: deque[float] = field(default_factory=deque)

    def healthy(self, now: float) -> None:
        if self.healthy_since is None:
            self.healthy_since = now

    def exited(self, now: float) -> Decision:
        p = self.policy
        if not p.enabled:
            return Decision(False, reason="restarts are off (--no-restart)")
        if self.healthy_since is not None and now - self.healthy_since >= p.reset_s:
            self.streak = 0
        self.healthy_since = None
        while self.restarts and now - self.restarts[0] > p.loop_window_s:
            self.restarts.popleft()
        if len(self.restarts) >= p.loop_restarts:
            return Decision(False, reason=f"crash loop: {len(self.restarts)} restarts within "
                                          f"{p.loop_window_s:g} s")
        delay = min(p.backoff_s * 2 ** self.streak, p.backoff_max_s)
        self.streak += 1
        return Decision(True, delay)

    def restarted(self, now: float) -> None:
        self.restarts.append(now)


class SupervisorMetrics:
    """The launcher's own Prometheus metrics (one registry per launcher)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.restarts = Counter("pdserve_process_restarts_total", "Times the launcher restarted this process.",
                                ("process",), registry=r)
        self.exits = Counter("pdserve_process_exits_total", "Times this process exited while the launch was up.",
                             ("process",), registry=r)
        self.up = Gauge("pdserve_process_up", "1 while the process runs and answers its health check.",
                        ("process",), registry=r)
        self.crash_loop = Gauge("pdserve_process_crash_loop", "1 once the process was given up in a crash loop.",
                                ("process",), registry=r)

    def track(self, name: str) -> None:
        """Make every series of ``name`` exist (at 0) before anything happens to it."""
        self.restarts.labels(name)
        self.exits.labels(name)
        self.crash_loop.labels(name).set(0)


@dataclass
class Supervised:
    child: Child
    tracker: RestartTracker
    state: str = STARTING
    restart_at: float = 0.0
    exited_at: float = 0.0

    @property
    def name(self) -> str:
        return self.child.name


class Supervisor:
    """Restarts the processes it watches; single-threaded, one :meth:`step` at a time.

    respawn(child): start that process again (same spec) and return the new Child. probe(child): True once the
    process serves (a worker's /health is 200). log: progress lines. clock: monotonic seconds.
    """

    def __init__(self, policy: RestartPolicy, respawn: Callable[[Child], Child], probe: Callable[[Child], bool],
                 log: Callable[[str], None] = lambda s: None, clock: Callable[[], float] = time.monotonic,
                 metrics: SupervisorMetrics | None = None) -> None:
        self.policy = policy
        self.respawn = respawn
        self.probe = probe
        self.log = log
        self.clock = clock
        self.metrics = metrics or SupervisorMetrics()
        self.procs: dict[str, Supervised] = {}
        self.closed = False

    def watch(self, child: Child, healthy: bool = True) -> None:
        """Supervise ``child`` (already started; ``healthy``: it passed its start-up health wait)."""
        s = Supervised(child, RestartTracker(self.policy))
        self.procs[child.name] = s
        self.metrics.track(child.name)
        if healthy:
            self._mark_up(s, self.clock(), quiet=True)

    def close(self) -> None:
        """An orderly shutdown is under way: restart nothing from now on."""
        self.closed = True

    def state(self, name: str) -> str:
        return self.procs[name].state

    def given_up(self) -> list[str]:
        return [n for n, s in self.procs.items() if s.state == GIVEN_UP]

    def step(self) -> None:
        for s in list(self.procs.values()):
            if self.closed:
                return
            now = self.clock()
            if s.state in (STARTING, UP) and not s.child.alive():
                self._exited(s, now)
            elif s.state == BACKOFF and now >= s.restart_at:
                self._restart(s, now)
            elif s.state == STARTING and self.probe(s.child):
                self._mark_up(s, self.clock())

    def _exited(self, s: Supervised, now: float) -> None:
        rc = s.child.proc.returncode
        s.exited_at = now
        self.metrics.exits.labels(s.name).inc()
        self.metrics.up.labels(s.name).set(0)
        d = s.tracker.exited(now)
        tail = s.child.log_tail(20)
        if not d.restart:
            s.state = GIVEN_UP
            self.metrics.crash_loop.labels(s.name).set(1)
            self.log(f"{s.name} (pid {s.child.pid}) exited with code {rc}; {d.reason}: giving it up, the rest keeps "
                     f"serving. Log {s.child.log_path}:\n{tail}")
            return
        s.state, s.restart_at = BACKOFF, now + d.delay_s
        self.log(f"{s.name} (pid {s.child.pid}) exited with code {rc}; restarting in {d.delay_s:g} s "
                 f"(exit {s.tracker.streak} in a row). Log {s.child.log_path}:\n{tail}")

    def _restart(self, s: Supervised, now: float) -> None:
        try:
            s.child = self.respawn(s.child)
        except Exception as e:  # a failed spawn is one more exit of the streak
            self.log(f"restarting {s.name} failed: {e}")
            s.tracker.restarted(now)
            self.metrics.restarts.labels(s.name).inc()
            d = s.tracker.exited(now)
            if d.restart:
                s.restart_at = now + d.delay_s
            else:
                s.state = GIVEN_UP
                self.metrics.crash_loop.labels(s.name).set(1)
                self.log(f"{s.name}: {d.reason}: giving it up")
            return
        s.tracker.restarted(now)
        s.state = STARTING
        self.metrics.restarts.labels(s.name).inc()
        self.log(f"restarted {s.name} (pid {s.child.pid}), restart {len(s.tracker.restarts)} within "
                 f"{self.policy.loop_window_s:g} s")

    def _mark_up(self, s: Supervised, now: float, quiet: bool = False) -> None:
        s.state = UP
        s.tracker.healthy(now)
        self.metrics.up.labels(s.name).set(1)
        if not quiet:
            self.log(f"{s.name} is healthy again, {now - s.exited_at:.1f} s after it exited")
