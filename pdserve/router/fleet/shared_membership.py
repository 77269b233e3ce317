"""Membership shared by the router replicas of one host: a JSON file they all read and write.

``pdserve serve`` gives every router process the same ``--membership-file`` (in the run folder). A worker added
or removed through ``/v1/pdserve/workers`` on one replica is written there (read, change, write a temporary file
and rename it, under an exclusive ``flock``: two replicas changing it at once both land); every replica checks
the file every ``POLL_S`` and brings its registry to the file's set (adds what is missing, removes what the file
no longer lists). A replica that starts, or restarts, with the file present takes the file's set rather than
its argv, so it serves the workers added at run time; the first replica of a launch creates the file from its
argv.

Why a file: the replicas share one public port (SO_REUSEPORT), so no replica can address another through it, and
the launcher already owns the run folder; a file needs no extra port, survives any replica's death, and is read
by a restarted replica before it serves. Across hosts (the chart) membership comes from discovery, which every
router pod runs against the same DNS names, so each replica reaches the same set by itself.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .kv_events import Publisher
from .registry import WorkerRegistry

log = logging.getLogger("pdserve.router.fleet.membership")

POLL_S = 0.5  # how often a replica checks the file: the lag of a change reaching every replica


def _entry(roles: set[str], publisher: Publisher | None) -> dict[str, Any]:
    out: dict[str, Any] = {"roles": sorted(roles)}
    if publisher is not None:
        out["kv_events"], out["kv_replay"] = publisher.endpoint, publisher.replay
    return out


class MembershipFile:
    """One replica's side of the shared file: its registry follows the file, its changes go into it."""

    def __init__(self, path: str | os.PathLike, registry: WorkerRegistry, publishers: dict[str, Publisher]) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.registry = registry
        self.publishers = publishers
        self.seen: tuple[int, int] | None = None  # (inode, mtime_ns) of the version last applied
        self.applied = 0  # versions of the file this replica brought its registry to

    # ---- the file ----
    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, dict[str, Any]] | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("membership file %s unreadable (%s); keeping this replica's set", self.path, e)
            return None
        workers = data.get("workers") if isinstance(data, dict) else None
        return workers if isinstance(workers, dict) else None

    def _write(self, workers: dict[str, dict[str, Any]]) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"workers": workers}, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _mine(self) -> dict[str, dict[str, Any]]:
        return {w.url: _entry(w.roles, self.publishers.get(w.url)) for w in self.registry}

    # ---- start, changes, following ----
    def start(self) -> None:
        """Take the file's set (a restarted replica), or create the file from this replica's (the first one)."""
        with self._locked():
            workers = self._read()
            if workers is None:
                self._write(self._mine())
            else:
                self.reconcile(workers)
            self.seen = self._stamp()

    def changed(self, url: str) -> None:
        """This replica added or removed ``url`` (through the membership API): write its entry into the file."""
        with self._locked():
            workers = self._read() or {}
            w = self.registry.get(url)
            if w is None:
                workers.pop(url, None)
            else:
                workers[url] = _entry(w.roles, self.publishers.get(url))
            self._write(workers)
            self.seen = self._stamp()

    def poll(self) -> bool:
        """Apply the file when another replica changed it; True when it did."""
        stamp = self._stamp()
        if stamp is None or stamp == self.seen:
            return False
        with self._locked():
            workers = self._read()
            self.seen = self._stamp()
        if workers is None:
            return False
        self.reconcile(workers)
        return True

    def reconcile(self, workers: dict[str, dict[str, Any]]) -> None:
        """Bring the registry to ``workers``: add missing workers and roles, remove workers no longer listed."""
        self.applied += 1
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

    async def follow(self) -> None:
        """Poll the file every ``POLL_S`` until cancelled."""
        while True:
            await asyncio.sleep(POLL_S)
            try:
                self.poll()
            except Exception:  # never let the loop die: the next round tries again
                log.exception("shared membership: reading %s failed", self.path)
