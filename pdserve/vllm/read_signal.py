"""D's wake-up when a KV read ends (issue 37: P's prefill pays for D's waiting).

While D's only requests wait for early reads (P still prefills), vLLM steps D's engine with nothing to run: each
empty step schedules, runs the worker's empty step, and sends the API server its stats. Paced at a millisecond that
is about a fifth of a core, on the cores P computes on when they share a host. When the worker's read threads live in
the scheduler's process (vLLM's one-process executor: one rank), the scheduler instead sleeps on this signal until a
read or a pool load has ended and not yet been collected by the worker's ``results``, or a bounded pause for
requests that arrive meanwhile. With the workers in other processes nothing attaches here, and the scheduler keeps
pacing by the clock.

No vLLM import.
"""

from __future__ import annotations

import threading


class ReadSignal:
    """Completed reads not yet collected, shared by the worker (which adds and collects them) and the scheduler
    (which waits for one) of one process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._workers = 0
        self._pending = 0

    def attach(self) -> None:
        """A worker rank lives in this process."""
        with self._cond:
            self._workers += 1

    def detach(self) -> None:
        with self._cond:
            self._workers = max(0, self._workers - 1)
            self._cond.notify_all()

    @property
    def local(self) -> bool:
        """Whether a worker of this process reports its reads here (else the scheduler cannot wait on it)."""
        return self._workers > 0

    def ended(self) -> None:
        """A read or pool load ended (the worker holds its result for the next ``results``)."""
        with self._cond:
            self._pending += 1
            self._cond.notify_all()

    def collected(self, n: int) -> None:
        """The worker's ``results`` took ``n`` ended reads."""
        if n:
            with self._cond:
                self._pending = max(0, self._pending - n)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until an ended read waits to be collected, or ``timeout_s``; whether one does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending > 0, timeout=max(0.0, timeout_s))


# one per process: vLLM builds the scheduler's and the worker's connector separately, in the same engine process
# under its one-process executor
READ_SIGNAL = ReadSignal()
