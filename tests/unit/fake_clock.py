"""A clock the conductor tests move by hand (``clock.t += 1.0``)."""

from __future__ import annotations


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t
