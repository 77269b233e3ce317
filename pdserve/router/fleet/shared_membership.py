"""Membership shared by the router replicas of one host: the ``workers`` section of their shared file
(:mod:`.shared_file`).

``pdserve serve`` gives every router process the same ``--membership-file`` (in the run folder). A worker added
or removed through ``/v1/pdserve/workers`` on one replica is written there; every replica checks the file every
``shared_file.POLL_S`` and brings its registry to the file's set (adds what is missing, removes what the file no longer
lists). A replica that starts, or restarts, with the section present takes the file's set rather than its argv,
so it serves the workers added at run time; the first replica of a launch creates the section from its argv.
Across hosts (the chart) membership comes from discovery, which every router pod runs against the same DNS names,
so each replica reaches the same set by itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .kv_events import Publisher
from .registry import WorkerRegistry
from .shared_file import Section, SectionFollower, SharedFile

log = logging.getLogger("pdserve.router.fleet.membership")


def _entry(roles: set[str], publisher: Publisher | None) -> dict[str, Any]:
    out: dict[str, Any] = {"roles": sorted(roles)}
    if publisher is not None:
        out["kv_events"], out["kv_replay"] = publisher.endpoint, publisher.replay
    return out


class MembershipFile(SectionFollower):
    """One replica's side of the ``workers`` section: its registry follows it, its changes go into it."""

    key = "workers"

    def __init__(self, path: str | os.PathLike | SharedFile, registry: WorkerRegistry,
                 publishers: dict[str, Publisher]) -> None:
        super().__init__(path if isinstance(path, SharedFile) else SharedFile(path))
        self.path = self.file.path
        self.registry = registry
        self.publishers = publishers

    def mine(self) -> Section:
        return {w.url: _entry(w.roles, self.publishers.get(w.url)) for w in self.registry}

    def changed(self, url: str) -> None:
        """This replica added or removed ``url`` (through the membership API): write its entry into the file."""
        def change(workers: Section) -> None:
            w = self.registry.get(url)
            if w is None:
                workers.pop(url, None)
            else:
                workers[url] = _entry(w.roles, self.publishers.get(url))
        self.write(change)

    def apply(self, section: Section) -> None:
        self.reconcile(section)

    def reconcile(self, workers: Section) -> None:
        """Bring the registry to ``workers``: add missing workers and roles, remove workers no longer listed."""
        for url in [w.url for w in self.registry if w.url not in workers]:
            log.info("worker %s left (shared membership)", url)
            self.publishers.pop(url, None)
            self.registry.remove(url)
        for url, entry in workers.items():
            roles = {r for r in entry.get("roles", ()) if isinstance(r, str)}
            if entry.get("kv_events"):
                self.publishers[url] = Publisher(str(entry["kv_events"]), str(entry.get("kv_replay") or ""))
            have = self.registry.get(url)
            missing = roles - (have.roles if have is not None else set())
            if not missing:
                continue
            log.info("worker %s joined as %s (shared membership)", url, ", ".join(sorted(missing)))
            for role in (["elastic"] if "elastic" in roles else sorted(missing)):
                self.registry.add(url, role)
