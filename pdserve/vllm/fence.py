"""P, worker side: what the hand-off board is told only once the device has run the kernels that wrote the bytes
(issue 37, layer-wise sends from device memory; docs/architecture.md, section 3, "Layer by layer").

vLLM calls ``save_kv_layer`` after a layer's attention and ``wait_for_save`` after the forward from the model's
thread, which on a GPU has queued those kernels, not run them. Telling the board then would let D read a layer (or,
without layer-wise sends, the whole prompt) before it is written. So the worker records a CUDA event on the current
stream at each call and hands the board's update to a :class:`DeviceFence`: one thread of its own waits for each
event and runs the updates in the order given. The model's thread only records the event and queues. Host memory
has no event: the update runs at once on the caller's thread, as it did before, unless updates are still queued
(then it waits its turn, so the board never sees them out of order).

No vLLM import; torch only in :func:`record_event`, for CUDA memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from pdserve.vllm.logs import connector_log

log = connector_log()


def record_event(cuda: bool) -> Any:
    """An event recorded on the current CUDA stream (after the kernels queued so far), or None for host memory."""
    if not cuda:
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


class DeviceFence:
    """Runs actions once their events completed, in the order given (see the module docstring). Thread-safe."""

    def __init__(self, name: str = "pdserve-fence") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[], None]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def after(self, event: Any, action: Callable[[], None]) -> None:
        """Run ``action`` once ``event`` (anything with ``synchronize()``; None: none) has completed and every action
        given before it has run."""
        with self._lock:
            if event is None and not self._pending:
                run_now = True
            else:
                run_now = False
                self._pending += 1
                self._queue.put((event, action))
                self._start()
        if run_now:
            action()

    def pending(self) -> int:
        """Actions queued and not yet run."""
        with self._lock:
            return self._pending

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            event, action = self._queue.get()
            try:
                if event is not None:
                    event.synchronize()
                action()
            except Exception:  # one failed update must not stop the ones after it
                log.exception("device fence: an update after the device's kernels failed")
            finally:
                with self._lock:
                    self._pending -= 1
