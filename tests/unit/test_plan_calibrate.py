"""Calibration fit recovers known coefficients; the fitted model is a CostModel the simulator accepts."""

import pytest

from pdserve.plan.calibrate import Calibration, fit
from pdserve.plan.results import Targets
from pdserve.plan.simulator import Cluster, SimSettings, simulate
from pdserve.plan.traffic import LengthMix, poisson


def test_fit_recovers_prefill_and_decode_terms(tmp_path):
    a, b, c = 0.02, 4e-4, 1e-8
    prefill = [(n, a + b * n + c * n * n / 2) for n in (64, 256, 512, 1024, 1536, 2000)]
    d0, d1, d2 = 0.03, 0.004, 1e-6
    decode = [(bt, ctx, d0 + d1 * bt + d2 * ctx) for bt, ctx in ((1, 88), (2, 176), (4, 352), (8, 704),
                                                                 (1, 1048), (4, 4192))]
    cal = fit(prefill, decode, kv_bytes_per_token=23040, bandwidth_bytes_s=4e9, handoff_s=0.05)
    assert cal.prefill_coef == pytest.approx([a, b, c], rel=1e-3, abs=1e-9)
    assert cal.decode_coef == pytest.approx([d0, d1, d2], rel=1e-3, abs=1e-9)
    m = cal.cost_model()
    assert m.prefill_s(1000, 0) == pytest.approx(a + b * 1000 + c * 1000 * 500)
    assert m.transfer_s(4e9) == pytest.approx(1.0 + 0.002)
    cal.save(tmp_path / "cal.json")
    assert Calibration.load(tmp_path / "cal.json").cost_model().decode_step_s(3, 300) == m.decode_step_s(3, 300)


def test_fitted_model_drives_the_simulator():
    cal = Calibration([0.02, 4e-4, 1e-8], [0.03, 0.004, 1e-6], 23040, 4e9, handoff_s=0.05)
    reqs = poisson(1.0, 40, LengthMix.parse("0.25:1536:32,0.75:128:32"), seed=0)
    out = simulate(Cluster(prefill=1, decode=1), cal.cost_model(),
                   SimSettings(Targets(2, 0.2), chunk_tokens=2048, kv_capacity_tokens=46000), reqs)
    assert out["completed"] == 40 and out["ttft_s"]["p50"] > 0.02
