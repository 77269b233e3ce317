"""pdserve.vllm.fence.DeviceFence: the board hears of bytes on a device only once their kernels ran, in order.

The events here are stand-ins for ``torch.cuda.Event`` (their ``synchronize()`` blocks until the test lets it
return); the real events run only on a GPU (benchmarks/gpu_transfer_check.py).
"""

from __future__ import annotations

import threading
import time

from pdserve.vllm.fence import DeviceFence, record_event

from .gate_event import GateEvent


def _until(check, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_host_memory_runs_the_update_at_once_on_the_caller_s_thread():
    fence, seen = DeviceFence(), []
    fence.after(None, lambda: seen.append(threading.current_thread().name))
    assert seen == [threading.current_thread().name] and fence.pending() == 0
    assert record_event(False) is None


def test_an_update_waits_for_its_event_and_the_updates_keep_their_order():
    fence, seen = DeviceFence(), []
    first, second = GateEvent(), GateEvent()
    fence.after(first, lambda: seen.append("layer 0"))
    fence.after(second, lambda: seen.append("layer 1"))
    fence.after(None, lambda: seen.append("first token"))  # no event, but after the two still queued
    time.sleep(0.05)
    assert seen == [] and fence.pending() == 3  # the kernels have not run: nothing told
    second.done()
    time.sleep(0.05)
    assert seen == []  # layer 1 waits for layer 0's turn
    first.done()
    _until(lambda: fence.pending() == 0)
    assert seen == ["layer 0", "layer 1", "first token"]
    fence.after(None, lambda: seen.append("next forward"))  # nothing queued: at once again
    assert seen[-1] == "next forward"


def test_a_failing_update_does_not_stop_the_ones_after_it():
    fence, seen = DeviceFence(), []
    event = GateEvent()

    def fail() -> None:
        raise RuntimeError("boom")

    fence.after(event, fail)
    fence.after(None, lambda: seen.append("after"))
    event.done()
    _until(lambda: fence.pending() == 0)
    assert seen == ["after"]
