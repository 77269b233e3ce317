"""The router's workers: who they are, their roles, whether they are healthy. One registry per app, shared by the
app (health probes, /ready), the membership API (add/remove) and placement (the conductor's copy follows it).

Everything that changes a worker goes through :class:`WorkerRegistry` (``add``, ``remove``, ``set_health``),
which tells its listeners at that moment; nobody re-reads the registry per request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

from .workers import Worker

log = logging.getLogger("pdserve.router")


class RegistryListener(Protocol):
    def worker_added(self, worker: Worker) -> None: ...

    def worker_removed(self, url: str) -> None: ...

    def health_changed(self, worker: Worker) -> None: ...


def role_of(roles: set[str]) -> str:
    """The conductor's role for a worker's set of router roles."""
    if "colocated" in roles:
        return "colocated"
    if {"prefill", "decode"} <= roles:
        return "both"
    return next(iter(roles))


class WorkerRegistry:
    def __init__(self, members: Iterable[tuple[str, str]] = ()) -> None:
        """``members``: (role, url) pairs; a url listed under two roles is one worker with both."""
        self._workers: dict[str, Worker] = {}
        self._listeners: list[RegistryListener] = []
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
        """Register ``url`` (or give it one more role); it counts as healthy until a probe or call says not."""
        w = self._workers.get(url) or Worker(url)
        w.roles.add(role)
        w.healthy, w.last_error = True, ""
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
