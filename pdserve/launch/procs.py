"""Child processes that never outlive the launcher: own process groups, parent-death signal, a reaper.

Three layers, so that no vLLM server (nor its engine-core grandchildren) is left behind:

1. Every child starts in its own session / process group (``start_new_session``), so Ctrl-C in the terminal
   reaches only the launcher, which then stops children in order, and stopping a child signals its whole
   group (the vLLM API server and the engine-core processes it forks).
2. ``PR_SET_PDEATHSIG`` (Linux): the kernel sends SIGKILL to a direct child when the thread that started it
   dies, even after ``kill -9`` of the launcher.
3. A reaper process (:class:`Reaper`) is told every child's process group; it reads a pipe from the launcher
   and, when that pipe closes without a clean goodbye (launcher killed), SIGKILLs every group still listed.
   That covers grandchildren, which PDEATHSIG does not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..http_probe import http_answer
from . import warm_start
from .deathsig import die_with_parent
from .ports import free_port, free_ports, port_is_free  # noqa: F401 (the launcher's and tests' import path)


class LaunchError(RuntimeError):
    """A process did not start or did not become healthy; the message carries its log tail."""


# --------------------------------------------------------------------------- cores


def available_cores() -> tuple[int, ...]:
    """CPU ids this process may run on (its affinity mask), sorted."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return tuple(range(os.cpu_count() or 1))


def assign_cores(n_workers: int, cores: Sequence[int], per_worker: int = 1) -> list[tuple[int, ...]]:
    """Round-robin: worker i gets ``per_worker`` consecutive entries of ``cores`` starting at i*per_worker
    (wrapping), so 2 workers on cores (0, 1) get (0,) and (1,); 3 workers get (0,), (1,), (0,)."""
    if not cores:
        raise ValueError("no CPU cores to assign")
    if per_worker < 1 or per_worker > len(cores):
        raise ValueError(f"per_worker={per_worker} must be 1..{len(cores)}")
    n = len(cores)
    return [tuple(cores[(i * per_worker + j) % n] for j in range(per_worker)) for i in range(n_workers)]


# --------------------------------------------------------------------------- spawning


def _deathsig_setup(parent_pid: int, deathsig: bool = True) -> Callable[[], None]:
    """preexec_fn for a child (runs between fork and exec: keep it tiny): unblock every signal (the mask survives
    exec, and the launcher holds SIGTERM/SIGINT/SIGHUP while its supervisor restarts a process), and with
    ``deathsig`` SIGKILL the child when the launcher dies."""

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if deathsig:
            die_with_parent(parent_pid)

    return setup


ProcessHandle = subprocess.Popen | warm_start.WarmProcess  # a child's process, executed or forked warm


@dataclass
class Child:
    """A started child process: its own process group, output in ``log_path``."""

    name: str
    proc: ProcessHandle
    log_path: Path | None
    argv: list[str]
    url: str = ""
    ready_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def startup_s(self) -> float:
        """Seconds from start to healthy (0.0 while not ready)."""
        return 0.0 if self.ready_at is None else self.ready_at - self.started_at

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: the child leads its own group

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines) if self.log_path else ""


def tail(path: Path | None, lines: int = 40, max_bytes: int = 64 << 10) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def rotate_log(path: Path, keep: int = 5) -> Path | None:
    """Keep a finished process's log: ``NAME.log`` -> ``NAME.log.1`` (the older ones shift to ``.2`` ...
    ``.keep``; older still are deleted), so the next start writes a fresh ``NAME.log``. Returns the kept path
    (None when there was no log)."""
    if not path.exists():
        return None
    oldest = path.with_name(f"{path.name}.{keep}")
    oldest.unlink(missing_ok=True)
    for k in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{k}")
        if older.exists():
            older.rename(path.with_name(f"{path.name}.{k + 1}"))
    kept = path.with_name(f"{path.name}.1")
    path.rename(kept)
    return kept


def spawn(
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    cwd: str | os.PathLike | None = None,
    reaper: Reaper | None = None,
) -> Child:
    """Start ``argv`` in its own process group with PDEATHSIG=SIGKILL (from the main thread), stdout+stderr
    to ``log_path``, its group registered with ``reaper``. With ``PDSERVE_WARM_START=1`` a vLLM server is forked
    from a warm starter instead (:mod:`pdserve.launch.warm_start`)."""
    proc = _warm_spawn(argv, env, log_path, cwd)
    if proc is not None:
        return _child(name, proc, log_path, argv, reaper)
    out = open(log_path, "ab", buffering=0) if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            list(argv),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # PDEATHSIG fires when the *thread* that forked the child exits, so only use it from the main
            # thread; the reaper covers children started from other threads.
            preexec_fn=_deathsig_setup(os.getpid(), threading.current_thread() is threading.main_thread()),
            close_fds=True,
        )
    finally:
        if not isinstance(out, int):
            out.close()
    return _child(name, proc, log_path, argv, reaper)


def _child(name: str, proc: ProcessHandle, log_path: Path | None, argv: Sequence[str],
           reaper: Reaper | None) -> Child:
    child = Child(name=name, proc=proc, log_path=log_path, argv=list(argv))
    if reaper is not None:
        reaper.add(child.pgid)
    return child


def _warm_spawn(argv: Sequence[str], env: Mapping[str, str] | None, log_path: Path | None,
                cwd: str | os.PathLike | None) -> ProcessHandle | None:
    """A process forked by this process's warm starter, or None where warm start is off or does not apply."""
    module = warm_start.module_of(argv) if warm_start.enabled() else None
    starter = warm_start.starter() if module is not None else None
    if starter is None:
        return None
    try:
        return starter.spawn(argv, dict(env) if env is not None else dict(os.environ),
                             os.fspath(cwd) if cwd is not None else None, os.fspath(log_path) if log_path else None)
    except warm_start.WarmStartError as e:
        warm_start.log.warning("%s; starting a new interpreter instead", e)
        return None


def signal_group(child: Child, sig: int) -> bool:
    """Send ``sig`` to the child's whole process group; False if it is already gone."""
    try:
        os.killpg(child.pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - group id reused by someone else's process
        return False


def group_alive(pgid: int) -> bool:
    """True while a non-zombie process is in group ``pgid`` (zombies whose parent died are not counted:
    some container inits reap them late)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    return bool(pids_in_group(pgid)) if os.path.isdir("/proc") else True


def stop_children(children: Sequence[Child], timeout_s: float = 20.0, reaper: Reaper | None = None) -> list[str]:
    """SIGTERM every child's group, wait up to ``timeout_s`` for all, then SIGKILL what is left and reap.
    Returns the names of the children that needed SIGKILL."""
    live = [c for c in children if c.alive() or group_alive(c.pgid)]
    for c in live:
        signal_group(c, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in live:
            c.proc.poll()
        if not any(c.alive() or group_alive(c.pgid) for c in live):
            break
        time.sleep(0.1)
    killed = []
    for c in live:
        if c.alive() or group_alive(c.pgid):
            killed.append(c.name)
            signal_group(c, signal.SIGKILL)
    for c in live:
        try:
            c.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass
        # grandchildren in the group may outlive the leader by a moment
        end = time.monotonic() + 5
        while group_alive(c.pgid) and time.monotonic() < end:
            signal_group(c, signal.SIGKILL)
            time.sleep(0.05)
    if reaper is not None:
        for c in children:
            if not group_alive(c.pgid):
                reaper.remove(c.pgid)
    return killed


# --------------------------------------------------------------------------- reaper

_REAPER_SRC = r"""
import os, signal, sys
groups = set()
clean = False
for line in sys.stdin:
    line = line.strip()
    if line == "bye":
        clean = True
        break
    if line[:1] == "+":
        groups.add(int(line[1:]))
    elif line[:1] == "-":
        groups.discard(int(line[1:]))
if not clean:
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
"""


class Reaper:
    """A tiny watchdog process: SIGKILLs the registered process groups if the launcher dies uncleanly.

    It is started with PDEATHSIG disabled on purpose (it must outlive the launcher by a moment) and in its
    own session, so Ctrl-C in the terminal does not stop it before the launcher has cleaned up.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _REAPER_SRC],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )

    def _send(self, line: str) -> None:
        with self._lock:
            if self.proc.stdin is None or self.proc.stdin.closed:
                return
            try:
                self.proc.stdin.write((line + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def add(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def remove(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def close(self) -> None:
        """Clean goodbye: the reaper exits without killing anything."""
        self._send("bye")
        with self._lock:
            if self.proc.stdin and not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- health


def wait_healthy(
    children: Sequence[Child],
    timeout_s: float,
    path: str = "/health",
    poll_s: float = 0.5,
    should_stop: Callable[[], bool] | None = None,
    on_ready: Callable[[Child], None] | None = None,
    watch: Sequence[Child] = (),
) -> None:
    """Wait until every child's ``url + path`` answers 200 (children that share a URL: until each has answered
    200 itself, by :data:`PID_HEADER`). Raises :class:`LaunchError` (with the failing
    child's log tail) as soon as one of them, or of ``watch`` (started, not yet waited for), exits, or when
    ``timeout_s`` passes."""
    pending = [c for c in children if c.ready_at is None]
    deadline = time.monotonic() + timeout_s
    while pending:
        if should_stop is not None and should_stop():
            raise LaunchError("launch interrupted")
        for c in watch:
            rc = c.proc.poll()
            if rc is not None:
                raise LaunchError(
                    f"{c.name} exited with code {rc} during start-up; log {c.log_path}:\n{_indent(c.log_tail())}"
                )
        for c in list(pending):
            rc = c.proc.poll()
            if rc is not None:
                log_tail = c.log_tail()
                hint = ""
                if "Address already in use" in log_tail or "Errno 98" in log_tail:
                    hint = (f" Another process took {c.url} between the launcher's free-port probe and the "
                            "bind; run again.")
                raise LaunchError(
                    f"{c.name} exited with code {rc} before it became healthy.{hint} Log {c.log_path}:\n"
                    f"{_indent(log_tail)}"
                )
            status, pid = http_answer(c.url + path)
            # processes that share a port (router replicas) say which of them answered: that one is ready
            who = c if pid is None else next((p for p in pending if p.proc.pid == pid), None)
            if status == 200 and who is not None:
                who.ready_at = time.monotonic()
                pending.remove(who)
                if on_ready is not None:
                    on_ready(who)
        if not pending:
            break
        if time.monotonic() > deadline:
            c = pending[0]
            names = ", ".join(p.name for p in pending)
            raise LaunchError(
                f"timed out after {timeout_s:g} s waiting for {names} to answer {path} ({c.url}); "
                f"raise the timeout (worker_timeout_s / --worker-timeout) if the machine is busy. "
                f"Last lines of {c.name}'s log {c.log_path}:\n{_indent(c.log_tail())}"
            )
        time.sleep(poll_s)


def spawn_healthy(name: str, argv: Sequence[str], url: str, timeout_s: float, env: Mapping[str, str] | None = None,
                  log_path: Path | None = None, cwd: str | os.PathLike | None = None, poll_s: float = 0.2) -> Child:
    """:func:`spawn` one child that serves ``url`` and :func:`wait_healthy` for its ``/health``; a child that exits
    or stays unhealthy past ``timeout_s`` is stopped and :class:`LaunchError` (with its log tail) is raised."""
    child = spawn(name, argv, env=env, log_path=log_path, cwd=cwd)
    child.url = url
    try:
        wait_healthy([child], timeout_s, poll_s=poll_s)
    except BaseException:
        stop_children([child], timeout_s=15.0)
        raise
    return child


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) if text else "    (log is empty)"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pids: Sequence[int], timeout_s: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive at the timeout."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not any(pid_alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def pids_in_group(pgid: int) -> list[int]:
    """Live pids whose process group is ``pgid`` (Linux /proc scan; used by tests and diagnostics)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        # fields after the ")" that closes comm: state ppid pgrp ...
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] != "Z":
            out.append(int(entry))
    return out

