"""How wrong the conductor's predictions are: each placement's predicted TTFT and TPOT against what its ticket
measured, as Prometheus histograms on the router's /metrics.

The ticket measures its own placement (:mod:`.ticket`): TTFT from the decision to its first output token (P's
token in a hand-off, the worker's in a whole request), TPOT over its later tokens. The conductor predicts the same
spans (queue + prefill from the moment of the decision; the decode step), so the difference is the model's error,
not the router's own overhead before placement. A migrated request's later tickets are placements of their own.

Two views of each error. ``*_prediction_error_seconds``: measured minus predicted, signed (positive: slower than
predicted); its buckets go below zero, so prometheus_client exports no ``_sum`` for it (only buckets and count:
``histogram_quantile`` works, a mean does not). ``*_prediction_error_ratio``: measured / predicted (1 is exact, 2
twice as slow), never negative, with a ``_sum`` for the mean. ``worker``: the worker that computed the prompt (TTFT)
or decoded (TPOT); ``policy``: the conductor's policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from ...conductor import Decision

# measured / predicted: a tenth .. ten times the prediction
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SECONDS_BUCKETS = tuple(sorted({-s for s in _S} | {0.0} | set(_S)))  # measured - predicted, in seconds


@dataclass(frozen=True)
class Measured:
    """What one ticket measured: seconds from its decision to its first token (None: no token came), and its mean
    time per output token after the first (None: fewer than two tokens)."""

    ttft_s: float | None
    tpot_s: float | None


def ratio(measured: float, predicted: float) -> float | None:
    """measured / predicted; None when nothing was predicted (a prediction of 0 has no relative error)."""
    return measured / predicted if predicted > 0 else None


class PredictionErrors:
    """The four histograms (TTFT and TPOT, in seconds and as a ratio), registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("worker", "policy")

        def hist(name: str, what: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, what, labels, buckets=buckets, registry=registry)

        self.ttft_s = hist("pdserve_router_ttft_prediction_error_seconds", "Measured minus predicted TTFT of each "
                           "placement (from the decision to its first token), by the worker computing the prompt.",
                           SECONDS_BUCKETS)
        self.ttft_ratio = hist("pdserve_router_ttft_prediction_error_ratio", "Measured / predicted TTFT of each "
                               "placement, by the worker computing the prompt.", RATIO_BUCKETS)
        self.tpot_s = hist("pdserve_router_tpot_prediction_error_seconds", "Measured minus predicted time per "
                           "output token of each placement, by the decoding worker.", SECONDS_BUCKETS)
        self.tpot_ratio = hist("pdserve_router_tpot_prediction_error_ratio", "Measured / predicted TPOT of each "
                               "placement, by the decoding worker.", RATIO_BUCKETS)

    def observe(self, decision: Decision, policy: str, measured: Measured) -> None:
        """One closed placement: its decision's predictions against what was measured (nothing for what was not)."""
        if measured.ttft_s is not None:
            worker = decision.prefill or decision.decode or ""
            self._one(self.ttft_s, self.ttft_ratio, worker, policy, measured.ttft_s, decision.ttft_s)
        if measured.tpot_s is not None:
            self._one(self.tpot_s, self.tpot_ratio, decision.decode or "", policy, measured.tpot_s, decision.tpot_s)

    @staticmethod
    def _one(seconds: Histogram, ratios: Histogram, worker: str, policy: str, measured: float,
             predicted: float) -> None:
        seconds.labels(worker, policy).observe(measured - predicted)
        r = ratio(measured, predicted)
        if r is not None:
            ratios.labels(worker, policy).observe(r)
