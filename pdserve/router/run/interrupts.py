"""Stopping a request's await on a worker from outside it: the request's deadline, a voluntary move, a client that
left. One :class:`Interrupts` per request's run; its attempts (:mod:`.attempt`) and the relay (:mod:`.relay`) say
when the run's task awaits a worker (:meth:`Interrupts.begin` / :meth:`Interrupts.end`), and an interrupt cancels
that await where it stands (the worker stream closes its connection, so vLLM aborts the request and frees its KV).
"""

from __future__ import annotations

import asyncio


class Interrupts:
    """The run's task while it awaits a worker, and why the run was interrupted (``reason``: None until then)."""

    __slots__ = ("task", "reason", "_cancelled")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None  # the task awaiting a worker right now, if any
        self.reason: str | None = None  # the first interrupt since the last reset
        self._cancelled = False  # interrupt cancelled ``task``, not yet seen by ``ours``

    def begin(self) -> asyncio.Task | None:
        """The current task starts awaiting a worker; returns it (for :meth:`ours`)."""
        task = self.task = asyncio.current_task()
        return task

    def end(self) -> None:
        self.task = None

    def interrupt(self, reason: str) -> bool:
        """Stop the run's await on a worker (``reason``: deadline, move, ...): cancel it now when the run awaits one
        (True), else the run sees ``reason`` before its next await."""
        if self.reason is None:
            self.reason = reason
        task = self.task
        if task is None:
            return False
        self._cancelled = True
        task.cancel()
        return True

    def ours(self, task: asyncio.Task | None) -> bool:
        """On a CancelledError while ``task`` awaited a worker: True when :meth:`interrupt` cancelled it and nothing
        else did (not also the client or the server); the flag is cleared."""
        if self._cancelled and task is not None:
            self._cancelled = False
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+; 3.10 cannot tell, takes it as ours
            return uncancel is None or uncancel() == 0
        return False

    def reset(self) -> None:
        """A new attempt begins: earlier interrupts are done with."""
        self.reason = None
        self._cancelled = False
