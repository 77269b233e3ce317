"""pdserve/vllm/nixl_progress.py: the threads NIXL's agent constructor starts are moved to SCHED_IDLE (real threads,
real scheduler calls), only when PDSERVE_NIXL_PROGRESS=idle."""

from __future__ import annotations

import os
import threading

import pytest

from pdserve.vllm import nixl_progress

from .plugin_check import ThreadStarter, check_register

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies only")


class Agent(ThreadStarter):
    """Stands in for nixl._api.nixl_agent: its constructor starts a thread, as NIXL's starts its progress thread."""


def test_threads_started_by_the_constructor_become_idle_and_others_do_not():
    other = Agent()  # started before: not the wrapped constructor's
    Agent.__init__ = nixl_progress.idle_threads_of(Agent.__init__)  # type: ignore[method-assign]
    agent = Agent()
    try:
        assert os.sched_getscheduler(agent.tid) == os.SCHED_IDLE
        assert os.sched_getscheduler(other.tid) != os.SCHED_IDLE
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE  # the caller's thread is not
    finally:
        for a in (agent, other):
            a.stop.set()
            a.thread.join(5)


def test_register_wraps_nothing_unless_asked(monkeypatch):
    check_register(monkeypatch, nixl_progress.register, nixl_progress.ENV, "idle", "nixl._api", "nixl_agent",
                   "_pdserve_idle")
