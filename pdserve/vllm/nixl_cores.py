"""A pinned CPU worker keeps its cores across vLLM's NixlConnector set-up: a vLLM general plugin (entry point
``vllm.general_plugins``).

vLLM 0.32's NixlConnector worker, on a CPU platform, "reserves" the last core of each NUMA node for KV transfer:
its constructor (``NixlBaseConnectorWorker.__init__``, nixl/base_worker.py) calls ``os.sched_setaffinity(0,
[last core of each node])``. Linux applies that to the calling thread only, and in a single-rank worker the
calling thread is the engine core's main thread, the one that runs the model's forward. The launcher binds each
CPU worker to its own cores (``VLLM_CPU_OMP_THREADS_BIND`` and OpenMP's variables, pdserve/launch/commands.py), so
on a 2-core machine P's forward left core 0 for core 1, D's core, and every thread started after it (Mooncake
Store's put, whose wait for completion spins on the clock) joined it there: three busy threads on D's core, none
on P's. Measured with a per-thread watcher and ``strace -k`` (docs/bench.md, "nixl+store on 2 cores"): D's Mooncake
Store client then went unheard by the master, which dropped its segment, and P's puts failed.

With ``PDSERVE_NIXL_KEEP_CORES=1`` in the worker's environment (the launcher sets it for NixlConnector workers on
CPU), the constructor is wrapped: the calling thread's affinity before it is put back after it, and so is that of
each thread the constructor started that was moved with it. Nothing else of vLLM or NIXL changes.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from .logs import connector_log
from .proc_threads import own_threads

ENV = "PDSERVE_NIXL_KEEP_CORES"  # "1": keep the worker's cores across NixlConnector's constructor
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


def register() -> None:
    """vLLM's plugin hook (every vLLM process): wrap NixlConnector's worker constructor when :data:`ENV` asks."""
    if os.environ.get(ENV) != "1" or not hasattr(os, "sched_setaffinity"):
        return
    try:
        module = importlib.import_module(WORKER_MODULE)
    except Exception:  # nixl or this vLLM's NixlConnector not importable here: nothing to do
        return
    worker = getattr(module, "NixlBaseConnectorWorker", None)
    if worker is None or getattr(worker.__init__, "_pdserve_keep_cores", False):
        return
    worker.__init__ = keep_cores_of(worker.__init__)


def keep_cores_of(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` wrapped: the calling thread's CPU affinity, and that of threads started meanwhile that took the
    caller's new one, back to what the caller had before."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        before = os.sched_getaffinity(0)
        threads = set(own_threads())
        init(self, *args, **kwargs)
        moved = os.sched_getaffinity(0)
        if moved == before:
            return
        back = [tid for tid in own_threads() if tid not in threads and _affinity(tid) == moved and _pin(tid, before)]
        _pin(0, before)
        connector_log().info("NixlConnector moved this worker's thread to cores %s (vLLM's CPU core reserved for KV "
                             "transfer); put back on its own cores %s (%s=1), with %d thread(s) started meanwhile",
                             sorted(moved), sorted(before), ENV, len(back))

    wrapped._pdserve_keep_cores = True  # type: ignore[attr-defined]
    return wrapped


def _affinity(tid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(tid)
    except OSError:  # the thread ended
        return None


def _pin(tid: int, cores: set[int]) -> bool:
    try:
        os.sched_setaffinity(tid, cores)
        return True
    except OSError as exc:
        connector_log().warning("thread %d not put back on cores %s: %s", tid, sorted(cores), exc)
        return False
