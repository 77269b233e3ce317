"""pdserve/vllm/nixl_progress.py: the threads NIXL's agent constructor starts are moved to SCHED_IDLE (real threads,
real scheduler calls), only when PDSERVE_NIXL_PROGRESS=idle."""

from __future__ import annotations

import os
import threading

import pytest

from pdserve.vllm import nixl_progress

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies only")


class Agent:
    """Stands in for nixl._api.nixl_agent: its constructor starts a thread, as NIXL's starts its progress thread."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.tid = 0
        ready = threading.Event()

        def run() -> None:
            self.tid = threading.get_native_id()
            ready.set()
            self.stop.wait(10)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)


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
    try:
        import nixl._api as api
    except Exception:
        api = None
    if api is not None:  # restored after the test: the wrapped constructor stays out of other tests
        monkeypatch.setattr(api.nixl_agent, "__init__", api.nixl_agent.__init__)
    monkeypatch.delenv(nixl_progress.ENV, raising=False)
    nixl_progress.register()  # no env: nothing wrapped
    assert api is None or not getattr(api.nixl_agent.__init__, "_pdserve_idle", False)
    monkeypatch.setenv(nixl_progress.ENV, "idle")
    nixl_progress.register()
    if api is None:
        return
    assert getattr(api.nixl_agent.__init__, "_pdserve_idle", False)
    before = api.nixl_agent.__init__
    nixl_progress.register()  # twice: wrapped once
    assert api.nixl_agent.__init__ is before
