"""Time predictions the conductor (and the planner's simulator) decide with.

:class:`CostModel` is the protocol; :class:`OnlineCostModel` fits it from what the router observes:

- prefill_s(new, cached) = a + b * new + c * new * (cached + new / 2)      (linear + attention term)
- decode_step_s(batch, ctx) = d0 + d1 * batch + d2 * ctx                   (one step of a decode batch)
- transfer_s(nbytes) = nbytes / bandwidth + per-transfer overhead
- handoff_s: fixed cost of moving a request from P to D (an exponential moving average)

Coefficients start from priors (a start-up calibration, or the defaults measured on a 2-core CPU with
SmolLM2-135M) and are refitted by least squares over a sliding window of observations, clamped >= 0 so a
noisy window can never predict negative or shrinking time for more work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class CostModel(Protocol):
    handoff_s: float
    kv_bytes_per_token: int

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float: ...

    def decode_step_s(self, batch: int, total_context_tokens: int) -> float: ...

    def transfer_s(self, nbytes: int) -> float: ...


def prefill_features(new: int, cached: int) -> tuple[float, float, float]:
    return (1.0, float(new), float(new) * (cached + new / 2.0))


def decode_features(batch: int, ctx: int) -> tuple[float, float, float]:
    return (1.0, float(batch), float(ctx))


class WindowFit:
    """Non-negative least squares over the last ``window`` (features, seconds) pairs, refitted lazily: at the
    first prediction after ``refit_every`` new observations (a refit costs ~0.3 ms; predictions ~1 us)."""

    def __init__(self, prior: Sequence[float], window: int = 256, min_obs: int | None = None,
                 refit_every: int = 8) -> None:
        self.prior = np.asarray(prior, dtype=float)
        self.coef: tuple[float, ...] = tuple(float(c) for c in self.prior)
        self.rows: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.min_obs = min_obs if min_obs is not None else len(prior) + 3
        self.refit_every = refit_every
        self._new = 0

    def add(self, x: Sequence[float], y: float) -> None:
        if y >= 0 and np.isfinite(y):
            self.rows.append((tuple(x), float(y)))
            self._new += 1

    def coefficients(self, force: bool = False) -> tuple[float, ...]:
        if self._new and (force or self._new >= self.refit_every or len(self.rows) == self.min_obs) \
                and len(self.rows) >= self.min_obs:
            self._new = 0
            X = np.array([r[0] for r in self.rows])
            y = np.array([r[1] for r in self.rows])
            self.coef = tuple(float(c) for c in _nnls(X, y, self.prior))
        return self.coef

    def predict(self, x: Sequence[float]) -> float:
        c = self.coefficients()
        if len(c) == 3:  # the hot path: three features
            return c[0] * x[0] + c[1] * x[1] + c[2] * x[2]
        return sum(a * b for a, b in zip(c, x))


def _nnls(X: np.ndarray, y: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative column and refit until none is negative.
    Columns the data cannot determine (all-constant beyond the intercept) keep their prior."""
    active = [j for j in range(X.shape[1]) if j == 0 or np.ptp(X[:, j]) > 0]
    fixed = [j for j in range(X.shape[1]) if j not in active]
    resid = y - (X[:, fixed] @ prior[fixed] if fixed else 0.0)
    coef = prior.copy()
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], resid, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            for j in [j for j in range(X.shape[1]) if j not in active and j not in fixed]:
                coef[j] = 0.0
            return coef
        active.pop(int(np.argmin(sol)))
    coef[:] = np.where(np.isin(np.arange(len(coef)), fixed), prior, 0.0)
    return coef


@dataclass
class Priors:
    """Starting coefficients. Defaults: SmolLM2-135M bf16 on one core of this 2-core CPU (vLLM 0.32)."""

    prefill: tuple[float, float, float] = (0.02, 4.0e-4, 1.0e-8)
    decode: tuple[float, float, float] = (0.035, 0.004, 1.0e-6)
    bandwidth_bytes_s: float = 4.0e9
    transfer_overhead_s: float = 0.002
    handoff_s: float = 0.06


class OnlineCostModel:
    """A :class:`CostModel` fitted from observations as they arrive."""

    def __init__(self, kv_bytes_per_token: int, priors: Priors | None = None, window: int = 256) -> None:
        p = priors or Priors()
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_fit = WindowFit(p.prefill, window)
        self.decode_fit = WindowFit(p.decode, window)
        self.bandwidth_bytes_s = p.bandwidth_bytes_s
        self.transfer_overhead_s = p.transfer_overhead_s
        self.handoff_s = p.handoff_s
        self.observations = {"prefill": 0, "decode": 0, "transfer": 0, "handoff": 0}

    # ---- predictions ----
    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return max(0.0, self.prefill_fit.predict(prefill_features(new_tokens, cached_tokens)))

    def decode_step_s(self, batch: int, total_context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return max(0.0, self.decode_fit.predict(decode_features(batch, total_context_tokens)))

    def transfer_s(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.transfer_overhead_s + nbytes / self.bandwidth_bytes_s

    # ---- observations ----
    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        self.prefill_fit.add(prefill_features(new_tokens, cached_tokens), seconds)
        self.observations["prefill"] += 1

    def observe_decode_step(self, batch: int, total_context_tokens: int, seconds: float) -> None:
        self.decode_fit.add(decode_features(batch, total_context_tokens), seconds)
        self.observations["decode"] += 1

    def observe_transfer(self, nbytes: int, seconds: float, alpha: float = 0.2) -> None:
        if nbytes <= 0 or seconds <= self.transfer_overhead_s:
            return
        bw = nbytes / (seconds - self.transfer_overhead_s)
        self.bandwidth_bytes_s = (1 - alpha) * self.bandwidth_bytes_s + alpha * bw
        self.observations["transfer"] += 1

    def observe_handoff(self, seconds: float, alpha: float = 0.2) -> None:
        if seconds >= 0:
            self.handoff_s = (1 - alpha) * self.handoff_s + alpha * seconds
            self.observations["handoff"] += 1

    def describe(self) -> dict:
        return {"prefill_coef": list(self.prefill_fit.coefficients(force=True)),
                "decode_coef": list(self.decode_fit.coefficients(force=True)),
                "bandwidth_bytes_s": self.bandwidth_bytes_s, "handoff_s": self.handoff_s,
                "observations": dict(self.observations)}
