"""The conductor's predictions corrected by their own measured error, online and bounded (issue 40).

The cost model (:mod:`.cost_model`) fits the parts of a request's time (a prefill of n tokens, a decode step of a
batch, a KV transfer) from what the router observes, over a long window (256 observations). What makes the whole
machine slower or faster for a while (another tenant on the cores, a hotter node, a change of traffic) it follows
only as slowly as that window turns over, and it moves every prediction by the same factor: measured on the
conversation trace on 2 shared cores, every TTFT and TPOT came out 2-3x the prediction for minutes at a time,
whatever the prompt (docs/conductor.md). Each closed placement measures its TTFT and TPOT
(:mod:`pdserve.router.fleet.ticket`); this module turns the recent ones into one factor per kind that multiplies
the conductor's predicted TTFT and TPOT.

    factor(kind) = exp(gain x median of log(measured / uncorrected prediction) over the last ``window`` placements)

- **Against the uncorrected prediction.** The window holds what the model alone got wrong, so the factor never
  learns from its own earlier value (a tracker of the corrected error overshot: its first value, the median of the
  first 4 errors while the model was still at its priors, stayed in force long after the model's refit had removed
  that error).
- **Fleet-wide, not per worker.** A per-worker factor learns from a fraction of the measurements and changes which
  worker wins a comparison on noise; one factor per kind leaves every comparison between workers as the model made
  it and corrects what all of them share. (An offline replay of a measured run: per-worker residual factors took
  the TTFT error p50 from 0.53 to 0.69 in |log2|.)
- **Only when the error is one-sided.** The factor stays 1 until the window holds ``min_obs`` measurements, and
  while the signs of its errors are balanced (a sign test: |over - under| < 2 sqrt(n), i.e. no bias at ~95%), so
  noise around an unbiased prediction is never "corrected".
- **Half way** (``gain`` 0.5). Measurements arrive only as placements close, so a burst of requests is placed with
  the factor the previous burst left, and the queueing part of the error changes from burst to burst (a deep queue
  is over-predicted more than a short one). Applying half the measured bias hedges between "it persists" and "it
  is gone by now": on three measured runs replayed offline it kept most of the gain where the bias lasted and
  stopped the correction from overshooting where it flipped between bursts (docs/conductor.md).
- **Bounded**: the factor within ``[1 / bound, bound]``; one measurement moves the median by at most one rank.

- **Not from the start-up transient.** The first placements are predicted by the start-up fit (measured on an idle
  engine), which the cost model's own refit corrects within a few requests; a factor learnt from them corrected
  an error already gone (TTFT on a quiet run: the first ten took 0.2-0.6x their prediction, the factor became 0.48
  and stayed in force over the next burst, which the model already predicted: error p50 +21%). Placements decided
  before the model timed ``warmup`` (16) live prefills do not teach the factor (:attr:`Decision.settled`).

``window`` 0 turns it off (the factor is always 1): the default, since in two of five measured runs the error
flipped from burst to burst and the correction, one burst late, raised it (docs/conductor.md). Only TTFT is
corrected by default (``kinds``): TPOT's correction made its error worse in 2 of 3 measured runs.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

KINDS = ("ttft", "tpot")
# what the conductor corrects by default: TTFT only. TPOT's correction made its error worse in 2 of 3 measured runs
# (the first burst's factor, learnt while the decode model still over-predicted 5x, stayed in force for the next
# burst, which the refitted model already predicted; docs/conductor.md)
CORRECTED = ("ttft",)


@dataclass
class Recalibration:
    """Fleet-wide correction factors of predicted TTFT and TPOT (see the module docstring)."""

    window: int = 0
    warmup: int = 16  # live prefills the cost model learns from before its error teaches the factor
    kinds: tuple[str, ...] = CORRECTED  # the kinds corrected (the others' factor stays 1)
    gain: float = 0.5
    bound: float = 4.0
    min_obs: int = 8
    errors: dict[str, deque[float]] = field(default_factory=dict)  # kind -> recent log(measured / uncorrected)
    _factor: dict[str, float] = field(default_factory=dict)  # kind -> the factor in force (recomputed per observe)

    def factor(self, kind: str) -> float:
        """What the conductor multiplies its ``kind`` prediction by (1: no correction)."""
        return self._factor.get(kind, 1.0)

    def observe(self, kind: str, measured: float, uncorrected: float) -> None:
        """One closed placement: ``measured`` seconds of ``kind`` against the model's own (uncorrected) prediction."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: one of {', '.join(KINDS)}")
        if self.window <= 0 or kind not in self.kinds or measured <= 0 or uncorrected <= 0:
            return
        errs = self.errors.setdefault(kind, deque(maxlen=self.window))
        errs.append(math.log(measured / uncorrected))
        self._factor[kind] = self._estimate(errs)

    def _estimate(self, errs: deque[float]) -> float:
        n = len(errs)
        if n < self.min_obs:
            return 1.0
        over = sum(1 for e in errs if e > 0)
        under = sum(1 for e in errs if e < 0)
        if abs(over - under) < 2.0 * math.sqrt(n):  # no bias the window can tell from noise
            return 1.0
        limit = math.log(self.bound)
        return math.exp(min(max(self.gain * statistics.median(errs), -limit), limit))

    def snapshot(self) -> dict[str, float]:
        """{kind: factor} in force (for /v1/pdserve/workers and the decision record)."""
        return {kind: round(self.factor(kind), 4) for kind in KINDS}
