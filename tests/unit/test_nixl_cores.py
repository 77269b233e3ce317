"""pdserve/vllm/nixl_cores.py: NixlConnector's constructor moves its caller to vLLM's reserved KV core; wrapped, the
caller (and each thread started meanwhile with it) gets its own cores back (real threads, real affinity calls), only
when PDSERVE_NIXL_KEEP_CORES=1."""

from __future__ import annotations

import os
import threading

import pytest

from pdserve.vllm import nixl_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity only")


class Worker:
    """Stands in for NixlBaseConnectorWorker: its constructor pins its caller to one core, as vLLM's reserves the
    last core of each NUMA node on CPU, then starts a thread (which inherits that core)."""

    def __init__(self, reserved: set[int]) -> None:
        self.stop = threading.Event()
        self.tid = 0
        ready = threading.Event()
        os.sched_setaffinity(0, reserved)

        def run() -> None:
            self.tid = threading.get_native_id()
            ready.set()
            self.stop.wait(10)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)


def _in_a_thread(fn) -> dict:
    """Run ``fn`` on a fresh thread (affinity changes stay off the test runner's thread); its result or error."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    th = threading.Thread(target=run)
    th.start()
    th.join(10)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_the_caller_and_threads_started_meanwhile_get_their_cores_back():
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("needs two cores to move a thread between")
    own, reserved = {min(cores)}, {max(cores)}
    Keep = type("Keep", (Worker,), {"__init__": nixl_cores.keep_cores_of(Worker.__init__)})

    def construct() -> tuple[set[int], set[int], set[int]]:
        os.sched_setaffinity(0, own)  # the worker's cores, as the launcher pins it
        plain = Worker(reserved)
        moved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, own)
        kept = Keep(reserved)
        try:
            return moved, os.sched_getaffinity(0), os.sched_getaffinity(kept.tid)
        finally:
            for w in (plain, kept):
                w.stop.set()
                w.thread.join(5)

    moved, caller, started = _in_a_thread(construct)
    assert moved == reserved  # unwrapped, the caller stays on the reserved core
    assert caller == own and started == own


def test_a_constructor_that_moves_nothing_is_left_alone():
    cores = os.sched_getaffinity(0)
    Keep = type("Keep", (Worker,), {"__init__": nixl_cores.keep_cores_of(Worker.__init__)})

    def construct() -> set[int]:
        w = Keep(cores)
        w.stop.set()
        w.thread.join(5)
        return os.sched_getaffinity(0)

    assert _in_a_thread(construct) == cores


def test_register_wraps_nothing_unless_asked(monkeypatch):
    try:
        import importlib

        module = importlib.import_module(nixl_cores.WORKER_CLASS)
    except Exception:
        module = None
    if module is not None:  # restored after the test: the wrapped constructor stays out of other tests
        monkeypatch.setattr(module.NixlBaseConnectorWorker, "__init__", module.NixlBaseConnectorWorker.__init__)
    monkeypatch.delenv(nixl_cores.ENV, raising=False)
    nixl_cores.register()  # no env: nothing wrapped
    assert module is None or not getattr(module.NixlBaseConnectorWorker.__init__, "_pdserve_keep_cores", False)
    monkeypatch.setenv(nixl_cores.ENV, "1")
    nixl_cores.register()
    if module is None:
        pytest.skip("vLLM's NixlConnector is not importable here")
    assert getattr(module.NixlBaseConnectorWorker.__init__, "_pdserve_keep_cores", False)
