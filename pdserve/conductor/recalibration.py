"""The conductor's predictions corrected by their own measured error, online and bounded (issue 40).

The cost model (:mod:`.cost_model`) fits the parts of a request's time (a prefill of n tokens, a decode step of a
batch, a KV transfer) from what the router observes. What it leaves out, it leaves out on every request: queueing
inside vLLM, the API server's own time, another tenant's load on a core, a hand-off's fixed costs. Each closed
placement measures its TTFT and TPOT (:mod:`pdserve.router.fleet.ticket`), so the error of the whole prediction is
known per worker; this module turns it into a per-worker factor that multiplies the conductor's predicted TTFT
(the worker computing the prompt) and TPOT (the worker decoding).

The factor tracks the **median** of measured / predicted (a stochastic-approximation quantile tracker on the log):

    log f  <-  log f + step * sign(log(measured / predicted))      (predicted: the corrected prediction, f included)

so f settles where half the corrected predictions are over and half under: the median error goes to 1 whatever the
skew of the error's distribution (a mean of log ratios would move the median off 1 when a few requests are far
faster than predicted, e.g. prefix hits the index did not know: measured on the conversation trace, it did).
``step`` is ``rate / 2`` in log units (rate 0.1: 5% a measurement). Bounded: one measurement moves f by at most that
step, f stays within ``[1 / bound, bound]``, and f is 1 until a worker has ``min_obs`` measurements of that kind
(then the median of those). ``rate`` 0 turns it off (f is always 1).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

KINDS = ("ttft", "tpot")


@dataclass
class Factor:
    """One worker's correction of one kind: log of the factor, how many measurements made it, and the first ones'
    log ratios (the warm-up)."""

    log: float = 0.0
    n: int = 0
    warm: list[float] = field(default_factory=list)


@dataclass
class Recalibration:
    """Per-worker correction factors of predicted TTFT and TPOT (see the module docstring)."""

    rate: float = 0.0
    bound: float = 4.0
    min_obs: int = 4
    factors: dict[tuple[str, str], Factor] = field(default_factory=dict)

    def factor(self, worker: str, kind: str) -> float:
        """What the conductor multiplies its ``kind`` prediction for ``worker`` by (1: no correction)."""
        if self.rate <= 0:  # off (the default): nothing to look up on the placement path
            return 1.0
        f = self.factors.get((worker, kind))
        if f is None or f.n < self.min_obs:
            return 1.0
        return math.exp(f.log)

    def observe(self, worker: str, kind: str, measured: float, predicted: float) -> None:
        """One closed placement: ``measured`` against the (corrected) ``predicted`` seconds of ``kind``."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: one of {', '.join(KINDS)}")
        if self.rate <= 0 or not worker or measured <= 0 or predicted <= 0:
            return
        f = self.factors.setdefault((worker, kind), Factor())
        err = math.log(measured / predicted)
        f.n += 1
        if f.n < self.min_obs:
            f.warm.append(err)
            return
        if f.n == self.min_obs:  # the warm-up's median (the predictions so far were not corrected)
            f.log = statistics.median([*f.warm, err])
            f.warm = []
        else:
            f.log += self.rate / 2 * ((err > 0) - (err < 0))
        limit = math.log(self.bound)
        f.log = min(max(f.log, -limit), limit)

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
