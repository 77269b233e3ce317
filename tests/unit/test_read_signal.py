"""D's wake-up when a read ends (pdserve.vllm.read_signal): the scheduler's wait ends at a read's end, not later."""

from __future__ import annotations

import threading
import time

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
