"""pdserve/vllm/nixl_cores.py: NixlConnector's constructor moves its caller to vLLM's reserved KV core; wrapped, the
caller (and each thread started meanwhile with it) gets its own cores back (real threads, real affinity calls), only
when PDSERVE_NIXL_KEEP_CORES=1."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from pdserve.vllm import nixl_cores

from .plugin_check import ThreadStarter, check_register

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity only")


def _worker_class(reserved: set[int], keep: bool) -> type:
    """Stands in for NixlBaseConnectorWorker: its constructor pins its caller to ``reserved`` (as vLLM's reserves the
    last core of each NUMA node on CPU), then starts a thread, which inherits it; ``keep``: wrapped."""

    def init(self: Any) -> None:
        ThreadStarter.__init__(self, lambda: os.sched_setaffinity(0, reserved))

    return type("Worker", (ThreadStarter,), {"__init__": nixl_cores.keep_cores_of(init) if keep else init})


def _in_a_thread(fn: Any) -> Any:
    """Run ``fn`` on a fresh thread (affinity changes stay off the test runner's thread); its result or error."""
    out: dict[str, Any] = {}

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

    def construct() -> tuple[set[int], set[int], set[int]]:
        os.sched_setaffinity(0, own)  # the worker's cores, as the launcher pins it
        plain = _worker_class(reserved, keep=False)()
        moved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, own)
        kept = _worker_class(reserved, keep=True)()
        try:
            return moved, os.sched_getaffinity(0), os.sched_getaffinity(kept.tid)
        finally:
            plain.end()
            kept.end()

    moved, caller, started = _in_a_thread(construct)
    assert moved == reserved  # unwrapped, the caller stays on the reserved core
    assert caller == own and started == own


def test_a_constructor_that_moves_nothing_is_left_alone():
    cores = os.sched_getaffinity(0)

    def construct() -> set[int]:
        _worker_class(cores, keep=True)().end()
        return os.sched_getaffinity(0)

    assert _in_a_thread(construct) == cores


def test_register_wraps_nothing_unless_asked(monkeypatch):
    check_register(monkeypatch, nixl_cores.register, nixl_cores.ENV, "1", nixl_cores.WORKER_MODULE,
                   "NixlBaseConnectorWorker", "_pdserve_keep_cores")
