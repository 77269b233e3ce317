"""D's wake-up when a read ends (pdserve.vllm.read_signal): the scheduler's wait ends at a read's end, not later."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.vllm.read_signal import ReadSignal


def test_local_only_while_a_worker_is_attached() -> None:
    sig = ReadSignal()
    assert not sig.local
    sig.attach()
    assert sig.local
    sig.detach()
    assert not sig.local
    sig.detach()  # a second close does not go negative
    sig.attach()
    assert sig.local


def test_wait_times_out_without_an_ended_read() -> None:
    sig = ReadSignal()
    t0 = time.monotonic()
    assert sig.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04


def test_a_read_ending_wakes_the_waiter_at_once() -> None:
    sig = ReadSignal()
    woke: list[float] = []

    def waiter() -> None:
        t0 = time.monotonic()
        assert sig.wait(5.0) is True
        woke.append(time.monotonic() - t0)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)
    sig.ended()
    th.join(2.0)
    assert not th.is_alive()
    assert woke and woke[0] < 1.0


def test_an_uncollected_read_keeps_the_wait_short_until_collected() -> None:
    sig = ReadSignal()
    sig.ended()
    sig.ended()
    assert sig.wait(1.0) is True  # pending: the step that collects it must run now
    sig.collected(1)
    assert sig.wait(0.0) is True
    sig.collected(1)
    assert sig.wait(0.01) is False
    sig.collected(3)  # more than pending (a pool job and a read taken together) never goes negative
    sig.ended()
    assert sig.wait(0.0) is True


# ---- the scheduler's empty steps while D's early read waits for P ----
def _d_waiting_on_an_early_read(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, SimpleNamespace]:
    """D's scheduler with one early read in flight (its request waits for P), its clock frozen, sleeps recorded."""
    from pdserve.router.run.early_dispatch import EngineBook, new_handoff_id
    from pdserve.vllm import scheduler as sched_mod
    from tests.unit.test_early_dispatch import P_URL, p_answer, side
    from tests.unit.test_vllm_prefill_seals import output
    from tests.unit.test_vllm_scheduler import Blocks, Req, prompt

    s, book = side(), EngineBook()
    book.learn(P_URL, p_answer())
    req = Req("d1", prompt(14), book.decode_params(P_URL, new_handoff_id(), 14))
    s.get_num_new_matched_tokens(req, 4)
    s.update_state_after_alloc(req, Blocks([5, 6, 7, 8], hashed=1), 9)
    (job,) = s.build_connector_meta(output({})).recv  # the read starts: from now on D's steps are empty
    assert job.req_id == "d1"
    clock = SimpleNamespace(sleeps=[], time=time.time, monotonic=time.monotonic)
    clock.sleep = clock.sleeps.append
    monkeypatch.setattr(sched_mod, "time", clock)
    return s, clock


def test_d_s_empty_steps_wait_on_the_signal_when_its_worker_is_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.vllm import scheduler as sched_mod

    s, clock = _d_waiting_on_an_early_read(monkeypatch)
    sig = ReadSignal()
    sig.attach()
    waits: list[float] = []
    monkeypatch.setattr(sig, "wait", waits.append)
    monkeypatch.setattr(sched_mod, "READ_SIGNAL", sig)
    s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert waits == [s.config.idle_wait_ms / 1e3] and clock.sleeps == []  # woken by the read's end, else bounded


def test_d_s_empty_steps_are_paced_by_the_clock_when_its_workers_are_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.vllm import scheduler as sched_mod

    s, clock = _d_waiting_on_an_early_read(monkeypatch)
    monkeypatch.setattr(sched_mod, "READ_SIGNAL", ReadSignal())  # no worker attached: TP > 1, other processes
    s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert clock.sleeps == [sched_mod.EARLY_PACE_MS / 1e3]
    s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=5))  # a step with work is never paced
    assert clock.sleeps == [sched_mod.EARLY_PACE_MS / 1e3]
