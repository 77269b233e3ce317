"""A stand-in for ``torch.cuda.Event`` in the fence tests: the kernels it follows have run once the test says so."""

from __future__ import annotations

import threading


class GateEvent:
    """``synchronize()`` returns once the test calls ``done()``; ``query()`` says whether it has."""

    def __init__(self) -> None:
        self._gate = threading.Event()

    def done(self) -> None:
        self._gate.set()

    def query(self) -> bool:
        return self._gate.is_set()

    def synchronize(self) -> None:
        assert self._gate.wait(10), "the test never let the event complete"
