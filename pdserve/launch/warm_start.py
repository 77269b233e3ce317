"""Warm start: vLLM servers forked from one interpreter that has already imported vLLM.

A vLLM OpenAI server on a 2-core machine spends ~80% of its start-up (~30 of ~40 s, measured with py-spy)
importing Python modules: torch, transformers and vLLM itself. With ``PDSERVE_WARM_START=1`` in the launcher's
environment, :func:`pdserve.launch.procs.spawn` starts such a server (``python -m vllm.entrypoints.openai.api_server``)
by asking a *warm starter* instead of executing a new interpreter: a child process of the launcher
(``python -m pdserve.launch.warm_start MODULE ...``) that imports those modules once, then forks one process per
request.
The forked process is an ordinary server process: its own session and process group, its own environment,
working directory, argv and log file, stdin from /dev/null, SIGKILL when the warm starter dies; it runs the
module's code as ``__main__`` (:mod:`runpy`), exactly as ``python -m MODULE`` would, and exits through the
interpreter's normal shutdown. vLLM forks its own workers after importing the same modules
(``VLLM_WORKER_MULTIPROC_METHOD=fork``); nothing has run a torch operation in the warm starter before it forks.

Off by default: the tests turn it on (tests/conftest.py), where ~30 vLLM servers start per run. The
launcher-side handle (:class:`WarmProcess`) answers like :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``,
``returncode``, signals); exit statuses come from the warm starter, which reaps its children. The two talk
JSON lines over a pair of pipes (local, one per launcher): requests
``{"id", "module", "argv", "env", "cwd", "log", "netns"}``, answers ``{"ready"}`` / ``{"id", "pid"}`` /
``{"id", "error"}`` / ``{"exit": pid, "code"}``. When the launcher's pipe closes (the launcher exited or was
killed), the warm starter SIGKILLs every child's group and exits. If the warm starter cannot start (an import
fails), :func:`starter` says so once in the log and spawn falls back to
executing a new interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .deathsig import LIBC, die_with_parent

ENV = "PDSERVE_WARM_START"
# the modules a warm starter runs (python -m MODULE), and what it imports before it forks
WARM_MODULES = ("vllm.entrypoints.openai.api_server", "pdserve.router")
PRELOAD = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry",
           "vllm.v1.engine.core", "vllm.v1.executor", "vllm.v1.worker.cpu_model_runner",
           "vllm.model_executor.models.llama", "pdserve.vllm.connector", "pdserve.router.app")
READY_TIMEOUT_S = 600.0
log = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def module_of(argv: Sequence[str]) -> str | None:
    """The module that ``argv`` runs when a warm starter can start it (``[sys.executable, "-m", MODULE, ...]``
    with MODULE in :data:`WARM_MODULES`, optionally after ``ip netns exec NAME``), else None."""
    _, argv = split_netns(argv)
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in WARM_MODULES:
        return argv[2]
    return None


def split_netns(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``ip netns exec NAME CMD...`` -> (NAME, CMD); anything else -> (None, argv). A warm child enters the named
    network namespace itself (``setns``), as ``ip netns exec`` would."""
    if len(argv) > 4 and list(argv[:3]) == ["ip", "netns", "exec"]:
        return argv[3], list(argv[4:])
    return None, list(argv)


class WarmStartError(RuntimeError):
    """The warm starter could not start, or could not fork a process."""


class WarmProcess:
    """A process forked by a :class:`WarmStarter`, answering like :class:`subprocess.Popen`."""

    def __init__(self, starter: WarmStarter, pid: int, args: Sequence[str]) -> None:
        self._starter = starter
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._starter.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._starter.wait_exit(0.05 if end is None else max(0.0, min(0.05, end - time.monotonic())))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """The launcher's side of one warm starter process (started at construction, ready when it returns)."""

    def __init__(self, modules: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> None:
        req_r, self._req_w = os.pipe()
        self._ans_r, ans_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.launch.warm_start", str(req_r), str(ans_w), *modules],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(req_r, ans_w), start_new_session=True, close_fds=True)
        os.close(req_r)
        os.close(ans_w)
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._answers: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._ready: dict[str, Any] | None = None
        self._gone = False
        self._next_id = 0
        threading.Thread(target=self._read, name="warm-start-reader", daemon=True).start()
        self._await_ready(timeout_s)

    def _await_ready(self, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._ready is not None or self._gone, timeout_s)
        ready = self._ready
        if ready is None or ready.get("error"):
            self.close()
            why = "it exited" if ready is None else ready["error"]
            raise WarmStartError(f"the warm starter did not become ready: {why}")

    def _read(self) -> None:
        with open(self._ans_r, "rb") as answers:
            for line in answers:
                self._take(json.loads(line))
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def _take(self, msg: dict[str, Any]) -> None:
        with self._cond:
            if "ready" in msg:
                self._ready = msg
            elif "exit" in msg:
                self._exits[msg["exit"]] = msg["code"]
            else:
                self._answers[msg["id"]] = msg
            self._cond.notify_all()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, log_path: str | None,
              timeout_s: float = 30.0) -> WarmProcess:
        """Fork a process that runs ``[ip netns exec NAME] python -m MODULE ARGS`` (``argv``) with this
        environment, folder and log."""
        netns, cmd = split_netns(argv)
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            req = {"id": rid, "argv": cmd[3:], "module": cmd[2], "env": dict(env), "cwd": cwd or os.getcwd(),
                   "log": log_path, "netns": netns}
            try:
                os.write(self._req_w, (json.dumps(req) + "\n").encode())
            except OSError as e:
                raise WarmStartError(f"the warm starter is gone ({e})") from e
            with self._cond:
                self._cond.wait_for(lambda: rid in self._answers or self._gone, timeout_s)
                answer = self._answers.pop(rid, None)
        if answer is None or "pid" not in answer:
            why = "no answer" if answer is None else answer.get("error")
            raise WarmStartError(f"the warm starter could not start {cmd[2]}: {why}")
        return WarmProcess(self, answer["pid"], argv)

    def exit_code(self, pid: int) -> int | None:
        """The exit code of a child that has exited (negative: killed by that signal), else None. Once the warm
        starter is gone, so are its children: SIGKILLed by their parent-death signal, or by the starter itself."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            return -signal.SIGKILL if self._gone else None

    def wait_exit(self, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait(timeout_s)

    def alive(self) -> bool:
        return self.proc.poll() is None and not self._gone

    def close(self) -> None:
        """Close the request pipe: the warm starter SIGKILLs what it still runs and exits."""
        with contextlib.suppress(OSError):
            os.close(self._req_w)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            self.proc.kill()
            self.proc.wait()


_STARTER: list[WarmStarter | None] = []  # this process's warm starter once tried (None: it could not start)
_STARTER_LOCK = threading.Lock()


def starter() -> WarmStarter | None:
    """This process's warm starter (started on first use, again if it died; None, logged, if it cannot start)."""
    with _STARTER_LOCK:
        if _STARTER and _STARTER[0] is not None and not _STARTER[0].alive():
            _STARTER.clear()
        if not _STARTER:
            try:
                _STARTER.append(WarmStarter(PRELOAD))
            except (WarmStartError, OSError) as e:
                log.warning("warm start off: %s; starting a new interpreter for each process instead", e)
                _STARTER.append(None)
        return _STARTER[0]


def close_all() -> None:
    with _STARTER_LOCK:
        if _STARTER and _STARTER[0] is not None:
            _STARTER[0].close()
        _STARTER.clear()


# --------------------------------------------------------------------------- the warm starter process

CLONE_NEWNET = 0x40000000


class _Requests:
    """Line-framed JSON requests from the launcher's pipe (select-driven, no buffered reads)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.closed = False

    def poll(self, timeout_s: float) -> list[dict[str, Any]]:
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if ready:
            data = os.read(self.fd, 1 << 16)
            self.closed = not data
            self.buf += data
        lines = self.buf.split(b"\n")
        self.buf = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def _serve(req_fd: int, ans_fd: int, modules: Sequence[str]) -> dict[str, Any]:
    """The warm starter's loop: import ``modules``, then fork a child per request and report exits. Returns only
    in a forked child, with the request that child is to run."""
    answers = os.fdopen(ans_fd, "w", buffering=1)

    def say(msg: dict[str, Any]) -> None:
        answers.write(json.dumps(msg) + "\n")

    try:
        for m in modules:
            importlib.import_module(m)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which falls back
        say({"ready": False, "error": f"import failed: {type(e).__name__}: {e}"})
        os._exit(1)
    say({"ready": True})
    requests, children = _Requests(req_fd), set()
    while not requests.closed:
        for req in requests.poll(0.1):
            pid = os.fork()
            if pid == 0:
                answers.close()
                os.close(req_fd)
                return req
            children.add(pid)
            say({"id": req["id"], "pid": pid})
        _reap(children, say)
    for pid in children:  # the launcher is gone: nothing it started may outlive it
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    while children:
        _reap(children, say)
        time.sleep(0.05)
    os._exit(0)


def _reap(children: set[int], say: Any) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        with contextlib.suppress(OSError):
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(req: dict[str, Any], parent: int) -> None:
    """In the forked child: a session of its own, SIGKILL when the warm starter dies, the request's log as
    stdout and stderr, its environment, folder and argv."""
    os.setsid()
    die_with_parent(parent)
    if req.get("netns"):
        _enter_netns(req["netns"])
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    out = os.open(req["log"] or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.dup2(nothing, 0)
    os.close(out)
    os.close(nothing)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    _openmp_as_exec(req["env"])
    sys.path[0] = req["cwd"]
    sys.argv = [req["module"], *req["argv"]]


def openmp_places(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The cores ``OMP_PLACES`` names when it is a list of single cores (``{0,2,3}``, as the launcher writes it,
    pdserve.launch.commands.omp_pin_env) and ``OMP_PROC_BIND`` binds; None otherwise."""
    places = env.get("OMP_PLACES", "").strip()
    if env.get("OMP_PROC_BIND", "").strip().lower() not in ("true", "close", "spread", "master", "primary") \
            or not (places.startswith("{") and places.endswith("}")):
        return None
    try:
        cores = tuple(int(c) for c in places[1:-1].split(","))
    except ValueError:
        return None
    return cores or None


def _openmp_as_exec(env: Mapping[str, str]) -> None:
    """A new interpreter's OpenMP runtime reads OMP_NUM_THREADS, OMP_PLACES and OMP_PROC_BIND when torch loads it;
    a forked child inherits the warm starter's runtime, which read them before this request's environment existed.
    So apply them as an exec would: the thread count through torch, the places as this process's CPU affinity
    (every thread started from now on inherits it)."""
    cores = openmp_places(env)
    if cores is not None:
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(0, cores)
    n = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if n.isdigit() and int(n) > 0 and torch is not None:
        torch.set_num_threads(int(n))


def _enter_netns(name: str) -> None:
    """Join the network namespace ``ip netns`` calls ``name`` (this process has one thread, so every thread it
    starts is in it too)."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if LIBC is None or LIBC.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno() if LIBC is not None else 0
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def main() -> None:
    req_fd, ans_fd, *modules = sys.argv[1:]
    for stream in (sys.stdout, sys.stderr):  # a forked child's output reaches its log line by line
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    parent = os.getpid()
    req = _serve(int(req_fd), int(ans_fd), modules)
    _become(req, parent)
    if req["module"] == WARM_MODULES[0]:
        from pdserve.vllm.engine_fork import fork_engine_core

        fork_engine_core()
    import runpy
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
