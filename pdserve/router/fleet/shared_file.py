"""The JSON file the router replicas of one host share (``--membership-file``, in the run folder), one section per
concern: ``workers`` (:mod:`.shared_membership`) and ``lora_adapters`` (:mod:`.shared_adapters`).

A change is read-change-write of the whole file under an exclusive ``flock`` (a temporary file renamed over it), so
two replicas changing it at once, in the same section or not, both land; a replica notices another's change by the
file's (inode, mtime). Why a file: the replicas share one public port (SO_REUSEPORT), so none can address another
through it; the launcher already owns the run folder; a file needs no extra port, no leader, survives any
replica's death and is read by a restarted replica before it serves.
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

log = logging.getLogger("pdserve.router.fleet.membership")

POLL_S = 0.5  # how often a replica checks the file: the lag of a change reaching every replica

Section = dict[str, Any]
Stamp = tuple[int, int]  # (inode, mtime_ns)


class SharedFile:
    """The file's path and the operations every section's follower uses."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("shared file %s unreadable (%s); keeping this replica's state", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}

    def section(self, key: str) -> Section | None:
        """The section ``key`` (None: no file, unreadable, or no such section)."""
        value = self._load().get(key)
        return value if isinstance(value, dict) else None

    def write(self, key: str, value: Section) -> None:
        """Replace section ``key``, keeping the others (call it under :meth:`locked`)."""
        data = self._load()
        data[key] = value
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def stamp(self) -> Stamp | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns


class SectionFollower:
    """One replica's side of one section: it takes the section when it starts (or creates it from its own state),
    writes its changes into it, and applies the others' when the file changes (``mine`` and ``apply`` are the
    section's owner's)."""

    key = ""

    def __init__(self, file: SharedFile) -> None:
        self.file = file
        self.seen: Stamp | None = None  # the file's version last read
        self.applied = 0  # versions of the section this replica brought its state to

    def mine(self) -> Section:
        raise NotImplementedError

    def apply(self, section: Section) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Take the file's section (a restarted replica), or create it from this replica's state (the first)."""
        with self.file.locked():
            section = self.file.section(self.key)
            if section is None:
                self.file.write(self.key, self.mine())
            else:
                self._apply(section)
            self.seen = self.file.stamp()

    def write(self, change: Any) -> None:
        """Write one of this replica's changes: ``change(section)`` edits the file's section in place."""
        with self.file.locked():
            section = self.file.section(self.key) or {}
            change(section)
            self.file.write(self.key, section)
            self.seen = self.file.stamp()

    def poll(self) -> bool:
        """Apply the section when another replica changed the file; True when it did."""
        stamp = self.file.stamp()
        if stamp is None or stamp == self.seen:
            return False
        with self.file.locked():
            section = self.file.section(self.key)
            self.seen = self.file.stamp()
        if section is None:
            return False
        self._apply(section)
        return True

    def _apply(self, section: Section) -> None:
        self.applied += 1
        self.apply(section)

    async def follow(self) -> None:
        """Poll the file every ``POLL_S`` until cancelled."""
        while True:
            await asyncio.sleep(POLL_S)
            try:
                self.poll()
            except Exception:  # never let the loop die: the next round tries again
                log.exception("shared %s: reading %s failed", self.key, self.file.path)
