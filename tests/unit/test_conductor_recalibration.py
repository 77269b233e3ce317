"""The conductor's predictions corrected by their measured error (pdserve/conductor/recalibration.py): bounded,
per worker and kind, off at rate 0, and applied to the predicted TTFT and TPOT the placement rules compare."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from pdserve.conductor.recalibration import Recalibration
from tests.unit.test_conductor_policy import make, req


def test_factor_settles_on_the_median_error():
    r = Recalibration(rate=0.1, min_obs=4)
    rng = random.Random(0)
    for _ in range(400):  # the model predicts half of what happens, with noise, and 1 in 5 requests far faster
        predicted = 0.1 * r.factor("w", "ttft")
        fast = rng.random() < 0.2
        r.observe("w", "ttft", 0.2 * math.exp(rng.gauss(0, 0.2)) * (0.1 if fast else 1.0), predicted)
    # the median of measured / raw prediction is ~2 (the fast fifth pulls a mean of logs to ~1.3)
    assert 1.7 < r.factor("w", "ttft") < 2.3
    assert r.factor("w", "tpot") == 1.0 and r.factor("other", "ttft") == 1.0  # per worker and kind


def test_bounded_warm_up_and_off():
    r = Recalibration(rate=0.2, min_obs=3, bound=4.0)
    r.observe("w", "tpot", 0.02, 0.01)
    r.observe("w", "tpot", 0.03, 0.01)
    assert r.factor("w", "tpot") == 1.0  # fewer than min_obs measurements: no correction yet
    r.observe("w", "tpot", 10.0, 0.01)
    assert r.factor("w", "tpot") == pytest.approx(3.0)  # the warm-up's median ratio, not its mean
    r.observe("w", "tpot", 1000.0, 0.03)
    assert r.factor("w", "tpot") == pytest.approx(3.0 * math.exp(0.1))  # one measurement: one bounded step
    for _ in range(50):
        r.observe("w", "tpot", 1000.0, 0.001)
    assert r.factor("w", "tpot") == pytest.approx(4.0)  # the factor within [1/4, 4]
    r.forget("w")
    assert r.factor("w", "tpot") == 1.0 and r.snapshot() == {}
    off = Recalibration(rate=0.0, min_obs=1)
    off.observe("w", "ttft", 1.0, 0.1)
    assert off.factor("w", "ttft") == 1.0
    with pytest.raises(ValueError):
        r.observe("w", "e2e", 1.0, 1.0)


def test_the_conductor_applies_and_learns_the_factors():
    c = make(recalibration_rate=0.1)
    q = req("r1", list(range(512)))
    before = c.place(q)
    assert before.kind == "disaggregated"
    p, d = before.prefill, before.decode
    for _ in range(8):  # what each later placement predicted (the factor in force) against 3x / 2x as slow
        f_p, f_d = c.recal.factor(p, "ttft"), c.recal.factor(d, "tpot")
        seen = dataclasses.replace(before, ttft_s=before.ttft_s * f_p, tpot_s=before.tpot_s * f_d)
        c.recalibrate(seen, 3 * before.ttft_s, 2 * before.tpot_s)
    c.finished("r1")
    pws = [w for w in c.workers.values() if w.role == "prefill"]
    options = {o.worker.worker_id: o.ttft_s for o in c.prefill_options(req("r3", list(range(2000, 2512))), pws, {},
                                                                       c.clock())}
    other = next(w for w in options if w != p)
    assert options[p] == pytest.approx(3 * options[other], rel=0.05)  # same load, p corrected 3x
    after = c.place(req("r2", list(range(1000, 1512))))
    # P measured 3x slower than predicted: the other prefill worker now wins
    assert after.prefill == other and after.decode == d
    assert after.tpot_s == pytest.approx(2 * before.tpot_s, rel=0.05)  # the one decode worker, 2x slower
    assert c.recal.snapshot()[p]["ttft"] == pytest.approx(3.0, rel=0.01)
    c.remove_worker(p)
    assert p not in c.recal.snapshot()
