"""The conductor's predictions corrected by their measured error (pdserve/conductor/recalibration.py): half way to
the median error of a recent window against the uncorrected prediction, fleet-wide, only when one-sided, bounded,
off at window 0, TTFT only unless asked, and applied to the predicted TTFT the placement rules compare."""

from __future__ import annotations

import math
import random

import pytest

from pdserve.conductor.recalibration import Recalibration
from tests.unit.test_conductor_policy import make, req


def test_a_one_sided_error_is_corrected_by_its_median():
    r = Recalibration(window=16, min_obs=8, gain=1.0)
    half = Recalibration(window=16, min_obs=8)  # the default gain: half way (log scale)
    rng = random.Random(0)
    for i in range(40):  # the machine runs 2x slower than the model says, with noise; 1 in 5 far faster
        fast = rng.random() < 0.2
        measured = 0.2 * math.exp(rng.gauss(0, 0.2)) * (0.1 if fast else 1.0)
        r.observe("ttft", measured, 0.1)
        half.observe("ttft", measured, 0.1)
        if i < 7:
            assert r.factor("ttft") == 1.0  # fewer than min_obs measurements: no correction yet
    assert 1.7 < r.factor("ttft") < 2.3  # the median, not pulled down by the fast fifth as a mean would be
    assert half.factor("ttft") == pytest.approx(math.sqrt(r.factor("ttft")))
    assert r.factor("tpot") == 1.0  # per kind
    both = Recalibration(window=8, min_obs=4, kinds=("ttft", "tpot"))
    for _ in range(8):
        r.observe("tpot", 0.2, 0.1)  # TPOT is not corrected by default ...
        both.observe("tpot", 0.2, 0.1)  # ... unless asked for
    assert r.factor("tpot") == 1.0 and both.factor("tpot") == pytest.approx(math.sqrt(2.0))


def test_noise_around_an_unbiased_prediction_is_left_alone():
    r = Recalibration(window=16, min_obs=8)
    rng = random.Random(1)
    corrected = 0
    for _ in range(500):  # unbiased, but each measurement off by up to ~2x
        r.observe("ttft", 0.05 * math.exp(rng.gauss(0, 0.5)), 0.05)
        corrected += r.factor("ttft") != 1.0
    assert corrected < 50  # the sign test holds the factor at 1 unless a window is lopsided by chance (< ~5%)


def test_the_window_forgets_and_the_factor_is_bounded():
    r = Recalibration(window=8, min_obs=4, bound=4.0)
    for _ in range(8):
        r.observe("ttft", 10.0, 0.1)
    assert r.factor("ttft") == pytest.approx(4.0)  # 100x measured, factor within [1/4, 4]
    for _ in range(8):
        r.observe("ttft", 0.05, 0.1)  # the machine became 2x faster than the model says: the old errors leave
    assert r.factor("ttft") == pytest.approx(math.sqrt(0.5))  # half way
    off = Recalibration(window=0, min_obs=1)
    off.observe("ttft", 1.0, 0.1)
    assert off.factor("ttft") == 1.0 and off.snapshot() == {"ttft": 1.0, "tpot": 1.0}
    with pytest.raises(ValueError):
        r.observe("e2e", 1.0, 1.0)


def test_the_conductor_applies_the_factors_and_learns_from_the_uncorrected_error():
    c = make(recalibration_window=8)
    first = c.place(req("r0", list(range(512))))
    assert first.kind == "disaggregated" and first.ttft_factor == 1.0 and first.tpot_factor == 1.0
    c.finished("r0")
    assert not first.settled  # the model has timed no live prefill yet: its start-up error teaches nothing
    for i in range(8):
        d = c.place(req(f"w{i}", list(range(50000 + 1000 * i, 50000 + 1000 * i + 512))))
        c.recalibrate(d, 3 * d.ttft_s, 2 * d.tpot_s)
        c.finished(d.request_id)
    assert c.recal.factor("ttft") == 1.0
    for i in range(c.recal.warmup):  # the model times its first live prefills (P answered)
        c.place(req(f"p{i}", list(range(90000 + 1000 * i, 90000 + 1000 * i + 64))))
        c.prefill_done(f"p{i}")
        c.finished(f"p{i}")
    assert c.prefills_seen == c.recal.warmup
    for i in range(8):  # every placement measured 3x / 2x the model's prediction, whatever was corrected
        d = c.place(req(f"r{i + 1}", list(range(1000 * (i + 1), 1000 * (i + 1) + 512))))
        c.recalibrate(d, 3 * d.ttft_s / d.ttft_factor, 2 * d.tpot_s / d.tpot_factor)
        c.finished(d.request_id)
    after = c.place(req("r9", list(range(20000, 20512))))
    assert after.ttft_factor == pytest.approx(math.sqrt(3.0)) and after.tpot_factor == 1.0  # TTFT only
    c.finished("r9")
    # the conductor's own figures stay what the model says: the factor multiplies them, fleet-wide
    again = c.place(req("r11", list(range(40000, 40512))))
    assert again.ttft_s / again.ttft_factor == pytest.approx(first.ttft_s, rel=0.01)
    assert again.ttft_s == pytest.approx(math.sqrt(3.0) * first.ttft_s, rel=0.01)
    assert again.tpot_s == pytest.approx(first.tpot_s, rel=0.01)
    off = make(recalibration_window=0)
    for i in range(20):
        d = off.place(req(f"x{i}", list(range(512))))
        off.recalibrate(d, 100 * d.ttft_s, 100 * d.tpot_s)
        off.finished(d.request_id)
    assert off.recal.factor("ttft") == 1.0 and d.ttft_factor == 1.0  # window 0: off
