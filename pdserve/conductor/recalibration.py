"""The conductor's predictions corrected by their own measured error, online and bounded (issue 40).

The cost model (:mod:`.cost_model`) fits the parts of a request's time (a prefill of n tokens, a decode step of a
batch, a KV transfer) from what the router observes. What it leaves out, it leaves out on every request: queueing
inside vLLM, the API server's own time, another tenant's load on a core, a hand-off's fixed costs. Each closed
placement measures its TTFT and TPOT (:mod:`pdserve.router.fleet.ticket`), so the error of the whole prediction is
known per worker; this module turns it into a per-worker factor that multiplies the conductor's predicted TTFT
(the worker computing the prompt) and TPOT (the worker decoding):

    log f  <-  log f + rate * log(measured / predicted)       (predicted: the corrected prediction, f included)

a step of a geometric moving average, so f settles where the corrected predictions are right on (geometric) mean.
Bounded three ways: each ratio is clipped to ``[1 / step, step]`` (one stalled request moves f by at most
``rate * log(step)``), f stays within ``[1 / bound, bound]``, and f is 1 until a worker has ``min_obs``
measurements of that kind. ``rate`` 0 turns it off (f is always 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KINDS = ("ttft", "tpot")


@dataclass
class Factor:
    """One worker's correction of one kind: log of the factor and how many measurements made it."""

    log: float = 0.0
    n: int = 0


@dataclass
class Recalibration:
    """Per-worker correction factors of predicted TTFT and TPOT (see the module docstring)."""

    rate: float = 0.1
    bound: float = 4.0
    step: float = 3.0
    min_obs: int = 4
    factors: dict[tuple[str, str], Factor] = field(default_factory=dict)

    def factor(self, worker: str, kind: str) -> float:
        """What the conductor multiplies its ``kind`` prediction for ``worker`` by (1: no correction)."""
        f = self.factors.get((worker, kind))
        if f is None or f.n < self.min_obs or self.rate <= 0:
            return 1.0
        return math.exp(f.log)

    def observe(self, worker: str, kind: str, measured: float, predicted: float) -> None:
        """One closed placement: ``measured`` against the (corrected) ``predicted`` seconds of ``kind``."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: one of {', '.join(KINDS)}")
        if self.rate <= 0 or not worker or measured <= 0 or predicted <= 0:
            return
        f = self.factors.setdefault((worker, kind), Factor())
        clipped = min(max(measured / predicted, 1 / self.step), self.step)
        if f.n >= self.min_obs:
            f.log = min(max(f.log + self.rate * math.log(clipped), -math.log(self.bound)), math.log(self.bound))
        else:  # warming up: the mean log ratio so far, applied once min_obs measurements are in
            f.log = min(max(f.log + (math.log(clipped) - f.log) / (f.n + 1), -math.log(self.bound)),
                        math.log(self.bound))
        f.n += 1

    def forget(self, worker: str) -> None:
        """``worker`` left or restarted: its corrections start again."""
        for kind in KINDS:
            self.factors.pop((worker, kind), None)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{worker: {kind: factor}} of the corrections in force (for /v1/pdserve/fleet and the decision record)."""
        out: dict[str, dict[str, float]] = {}
        for worker, kind in sorted(self.factors):
            out.setdefault(worker, {})[kind] = round(self.factor(worker, kind), 4)
        return out
