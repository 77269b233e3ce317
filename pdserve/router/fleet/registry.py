"""The router's workers: who they are, their roles, whether they are healthy. One registry per app, shared by the
app (health probes, /ready), the membership API (add/remove) and placement (the conductor's copy follows it).

Everything that changes a worker goes through :class:`WorkerRegistry` (``add``, ``remove``, ``set_health``),
which tells its listeners at that moment; nobody re-reads the registry per request.

A slow worker is not a dead one (:meth:`WorkerRegistry.report_probe`): a worker is taken out on evidence of death
(connection refused, or its /health answering non-200) or when its probes have failed ``probe_failures`` times in
a row over at least ``probe_window_s``; a probe that merely timed out once under load changes nothing. One
successful probe takes a worker back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from ..config import ELASTIC_ROLES
from ..workers.client import Probe, Worker

log = logging.getLogger("pdserve.router")


class RegistryListener(Protocol):
    def worker_added(self, worker: Worker) -> None: ...

    def worker_removed(self, url: str) -> None: ...

    def health_changed(self, worker: Worker) -> None: ...


def role_of(roles: set[str]) -> str:
    """The conductor's role for a worker's set of router roles."""
    if "colocated" in roles:
        return "colocated"
    if "elastic" in roles:  # listed as prefill + decode + elastic: no fixed role, chosen per request
        return "elastic"
    if {"prefill", "decode"} <= roles:
        return "both"
    return next(iter(roles))


class WorkerRegistry:
    def __init__(self, members: Iterable[tuple[str, str]] = (), probe_failures: int = 3,
                 probe_window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        """``members``: (role, url) pairs; a url listed under two roles is one worker with both."""
        self._workers: dict[str, Worker] = {}
        self._listeners: list[RegistryListener] = []
        self.probe_failures = probe_failures
        self.probe_window_s = probe_window_s
        self.clock = clock
        self._failing: dict[str, tuple[float, int]] = {}  # url -> (first failed probe of the run, failures)
        for role, url in members:
            self._workers.setdefault(url, Worker(url)).roles.add(role)

    # ---- reading ----
    def __getitem__(self, url: str) -> Worker:
        return self._workers[url]

    def __contains__(self, url: object) -> bool:
        return url in self._workers

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def healthy(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.healthy]

    def with_role(self, role: str) -> list[Worker]:
        return [w for w in self._workers.values() if role in w.roles]

    # ---- changing ----
    def subscribe(self, listener: RegistryListener) -> None:
        """``listener`` hears of every change from now on, and of the workers already here as added."""
        self._listeners.append(listener)
        for w in list(self._workers.values()):
            listener.worker_added(w)

    def add(self, url: str, role: str) -> Worker:
        """Register ``url`` (or give it one more role); it counts as healthy until a probe or call says not. Role
        ``elastic`` (no fixed role) gives it prefill, decode and elastic at once, as ``--elastic`` lists it, so
        the conductor never sees it with a fixed role."""
        w = self._workers.get(url) or Worker(url)
        w.roles.update(ELASTIC_ROLES if role == "elastic" else (role,))
        w.healthy, w.last_error = True, ""
        self._failing.pop(url, None)
        self._workers[url] = w
        for listener in self._listeners:
            listener.worker_added(w)
        return w

    def remove(self, url: str) -> Worker | None:
        """No new requests go to it from now on; requests already there finish."""
        w = self._workers.pop(url, None)
        if w is not None:
            for listener in self._listeners:
                listener.worker_removed(url)
        return w

    def set_health(self, url: str, healthy: bool, detail: str = "") -> bool:
        """Record a probe's or a call's verdict; True when the worker's health changed."""
        w = self._workers.get(url)
        if w is None:
            return False
        w.last_error = "" if healthy else detail
        if w.healthy == healthy:
            return False
        log.warning("worker %s is now %s (%s)", url, "healthy" if healthy else "unhealthy", detail)
        w.healthy = healthy
        for listener in self._listeners:
            listener.health_changed(w)
        return True

    def report_probe(self, url: str, probe: Probe) -> bool:
        """Record one health probe; True when the worker's health changed. Evidence of death takes it out at once;
        plain failures (timeouts, broken connections) only after ``probe_failures`` in a row spanning
        ``probe_window_s``; until then it keeps serving, its ``last_error`` says what the probe saw."""
        w = self._workers.get(url)
        if w is None:
            return False
        if probe.ok:
            self._failing.pop(url, None)
            return self.set_health(url, True)
        if probe.dead:
            self._failing.pop(url, None)
            return self.set_health(url, False, probe.detail)
        now = self.clock()
        first, n = self._failing.get(url, (now, 0))
        self._failing[url] = (first, n + 1)
        if n + 1 >= self.probe_failures and now - first >= self.probe_window_s:
            return self.set_health(url, False, f"{n + 1} probes failed over {now - first:.1f} s, last: "
                                                f"{probe.detail}")
        if w.healthy:
            w.last_error = f"slow: {probe.detail} ({n + 1} failed probe(s) in a row)"
        return False

    def mark_dead(self, url: str, detail: str) -> bool:
        """A call found the worker gone (connection refused): out at once, back on its next good probe."""
        self._failing.pop(url, None)
        return self.set_health(url, False, detail)
