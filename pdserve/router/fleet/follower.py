"""The loop that follows an outside record of pooled blocks into the conductor's index: poll it every
``interval_s``; while it does not answer, forget what it said (the conductor then assumes nothing is pooled, never
more), warning once, until it answers again. Subclasses say how to poll and what to forget."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("pdserve.router.fleet.follower")


class Follower:
    source = "the pool"  # names it in the log
    interval_s = 1.0
    reachable = False
    task: asyncio.Task[None]

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def step(self) -> None:
        """One poll, applied to the index; raises when the source does not answer."""
        raise NotImplementedError

    def forget(self) -> None:
        """Drop everything the source said."""
        raise NotImplementedError

    def found(self) -> None:
        """The source answers (again) after it did not."""

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
                if not self.reachable:
                    self.found()
                self.reachable = True
            except asyncio.CancelledError:
                raise
            except Exception as e:  # master down or restarting: forget it until it answers again
                if self.reachable:
                    log.warning("%s unreachable (%s); ignoring pooled prefixes until it is back", self.source, e)
                self.reachable = False
                self.forget()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
