"""pdserve plan's hand-off model (issue 37): early dispatch and layer-wise KV transfer against the sequential
hand-off, by hand on a toy cost model, then in the simulator on a GPU preset."""

from __future__ import annotations

import pytest

from pdserve.plan.cost import HardwareCostModel, Parallelism
from pdserve.plan.hardware import accelerator, link
from pdserve.plan.kvsize import load_model
from pdserve.plan.results import Targets
from pdserve.plan.simulator import HANDOFFS, Cluster, SimSettings, Simulation, handoff_ready_s
from pdserve.plan.traffic import LengthMix, poisson
from pdserve.settings.errors import ConfigError


class Toy:
    """1 GB/s and 1 ms per batch; a 10 ms router hand-off."""

    handoff_s = 0.010

    def transfer_s(self, nbytes: float) -> float:
        return nbytes / 1e9 + 0.001 if nbytes > 0 else 0.0


def test_sequential_handoff_is_transfer_after_prefill_then_the_routers_handoff():
    landed, ready = handoff_ready_s(Toy(), 100_000_000, 0, now=1.0, prefill_start=0.5, placed=0.4, link_free=0.0)
    assert landed == pytest.approx(1.101) and ready == pytest.approx(1.111)
    landed, _ = handoff_ready_s(Toy(), 100_000_000, 0, now=1.0, prefill_start=0.5, placed=0.4, link_free=1.05)
    assert landed == pytest.approx(1.151)  # queued behind the link's previous transfer


def test_layerwise_transfer_hides_behind_the_prefill_but_one_layers_worth():
    # 100 MB over 10 layers: 11 ms a layer; a 500 ms prefill hides all but the last layer
    landed, ready = handoff_ready_s(Toy(), 100_000_000, 10, now=1.0, prefill_start=0.5, placed=0.4, link_free=0.0)
    assert landed == pytest.approx(1.011) and ready == pytest.approx(1.011)  # D's intake ended at 0.41
    # a prefill of 50 ms cannot hide 110 ms of transfer: the link sets the landing
    landed, _ = handoff_ready_s(Toy(), 100_000_000, 10, now=1.0, prefill_start=0.95, placed=0.9, link_free=0.0)
    assert landed == pytest.approx(0.95 + 0.110)
    # a request placed just before its prefill ended waits for D's intake, not for the KV
    _, ready = handoff_ready_s(Toy(), 1_000, 10, now=1.0, prefill_start=0.999, placed=0.999, link_free=0.0)
    assert ready == pytest.approx(1.009)


@pytest.fixture(scope="module")
def cost():
    return HardwareCostModel(load_model("llama-3-70b"), accelerator("H200"), link("efa-p5en"), Parallelism(tp=4))


def test_cost_model_counts_the_kv_layers(cost):
    assert cost.layers == 80


@pytest.mark.parametrize("prompt, hidden", [(2000, 0.7), (8000, 0.9)])  # a longer prefill hides more of the KV
def test_layerwise_shortens_the_predicted_gap_and_hides_the_transfer(cost, prompt, hidden):
    reqs = poisson(0.2, 40, LengthMix.parse(f"1:{prompt}:50"), seed=1)
    runs = {}
    for handoff in HANDOFFS:
        settings = SimSettings(Targets(5.0, 0.1), kv_capacity_tokens=cost.kv_capacity_tokens(), handoff=handoff)
        runs[handoff] = Simulation(Cluster(prefill=1, decode=1), cost, settings).run(reqs)
    on, early, off = runs["layerwise"], runs["early"], runs["serial"]
    assert off["transfer"]["hidden_share"] == 0.0 and on["transfer"]["hidden_share"] > hidden
    assert early["transfer"]["hidden_share"] == 0.0  # early dispatch alone moves the whole KV after the prefill
    assert on["transfer"]["mean_s"] == pytest.approx(off["transfer"]["mean_s"])  # the same bytes move
    assert on["handoff_gap_s"]["p50"] < early["handoff_gap_s"]["p50"] < off["handoff_gap_s"]["p50"]
    # what overlap takes off the gap: the router's hand-off and all but one layer's transfer (light load: no queue)
    saved = off["handoff_gap_s"]["p50"] - on["handoff_gap_s"]["p50"]
    per_layer = cost.transfer_s(on["transfer"]["mean_bytes"] / cost.layers)
    assert saved == pytest.approx(cost.handoff_s + on["transfer"]["mean_s"] - per_layer, rel=0.25)
    # early dispatch alone takes off the router's hand-off (D's intake ran beside the prefill)
    assert off["handoff_gap_s"]["p50"] - early["handoff_gap_s"]["p50"] == pytest.approx(cost.handoff_s, rel=0.25)
    assert on["ttft_s"]["p50"] == pytest.approx(off["ttft_s"]["p50"])  # P's side is unchanged


def test_the_default_hand_off_is_what_pdserve_does_layer_by_layer():
    assert SimSettings(Targets(5.0, 0.1)).handoff == "layerwise"
    with pytest.raises(ConfigError, match="early, layerwise, serial"):
        SimSettings(Targets(5.0, 0.1), handoff="overlap")


def test_colocated_gap_is_one_decode_step(cost):
    reqs = poisson(0.2, 20, LengthMix.parse("1:1000:20"), seed=2)
    out = Simulation(Cluster(colocated=1), cost, SimSettings(Targets(5.0, 0.1),
                                                             kv_capacity_tokens=cost.kv_capacity_tokens())).run(reqs)
    assert out["handoff_gap_s"]["p50"] == pytest.approx(out["tpot_s"]["p50"], rel=0.1)
    assert "transfer" not in out
