"""Where a request runs. The router asks a :class:`Placement` policy; round-robin is the baseline.

A later conductor (prefix- and load-aware) implements the same interface: ``choose(prompt_ids, exclude)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from .errors import unavailable
from .workers import Worker


@dataclass(frozen=True)
class Choice:
    """decode always set; prefill None means "run the whole request on decode" (colocated/decode-local)."""

    decode: Worker
    prefill: Worker | None = None


class Placement(Protocol):
    def choose(self, prompt_ids: Sequence[int], exclude: frozenset[str] = frozenset()) -> Choice: ...


class _Ring:
    def __init__(self, workers: Sequence[Worker], role: str) -> None:
        self.workers = list(workers)
        self.role = role
        self.next = 0

    def pick(self, exclude: frozenset[str]) -> Worker:
        n = len(self.workers)
        for k in range(n):
            w = self.workers[(self.next + k) % n]
            if w.healthy and w.url not in exclude:
                self.next = (self.next + k + 1) % n
                return w
        detail = "; ".join(f"{w.url}: {w.last_error or 'excluded'}" for w in self.workers)
        raise unavailable(f"no healthy {self.role} worker ({detail})")


class RoundRobin:
    """Round-robin over prefill workers and, independently, over decode workers (or colocated workers)."""

    def __init__(self, prefill: Sequence[Worker], decode: Sequence[Worker], colocated: Sequence[Worker]) -> None:
        self.colocated = _Ring(colocated, "colocated") if colocated else None
        self.prefill = _Ring(prefill, "prefill") if prefill else None
        self.decode = _Ring(decode, "decode") if decode else None

    def choose(self, prompt_ids: Sequence[int], exclude: frozenset[str] = frozenset()) -> Choice:
        if self.colocated is not None:
            return Choice(decode=self.colocated.pick(exclude))
        assert self.prefill is not None and self.decode is not None
        p = self.prefill.pick(exclude)
        return Choice(decode=self.decode.pick(exclude), prefill=p)
