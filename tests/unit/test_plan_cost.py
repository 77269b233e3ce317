"""Hardware cost model: monotone in work, consistent in units, protocol-complete."""

import pytest

from pdserve.conductor.cost_model import CostModel
from pdserve.plan.cost import HardwareCostModel, Parallelism, min_parallel
from pdserve.plan.hardware import accelerator, link, load_catalogue
from pdserve.plan.kvsize import load_model


def _cost(name="llama-3-70b", acc="H200", net="efa-p5en", tp=None):
    m = load_model(name)
    a, net_link = accelerator(acc), link(net)
    return HardwareCostModel(m, a, net_link, Parallelism(tp, tp) if tp else min_parallel(m, a, net_link))


def test_implements_the_conductor_protocol():
    c: CostModel = _cost()
    assert isinstance(c.kv_bytes_per_token, int) and c.handoff_s >= 0
    assert c.prefill_s(0, 0) == 0 and c.decode_step_s(0, 0) == 0 and c.transfer_s(0) == 0


@pytest.mark.parametrize("name", ["llama-3-70b", "qwen3-235b-a22b", "deepseek-v3", "mimo-v2-flash"])
def test_monotone_in_every_argument(name):
    c = _cost(name)
    # small prefills may be bound by reading the weights (flat), large ones by FLOPs (growing)
    assert c.prefill_s(1000, 0) <= c.prefill_s(2000, 0) <= c.prefill_s(4000, 0)
    assert c.prefill_s(8000, 0) < c.prefill_s(16000, 0) < c.prefill_s(64000, 0)
    assert c.prefill_s(1000, 0) < c.prefill_s(1000, 30000)  # attention over a cached prefix costs
    assert c.decode_step_s(1, 1000) <= c.decode_step_s(8, 8000) <= c.decode_step_s(64, 64000)
    assert c.decode_step_s(8, 8000) < c.decode_step_s(8, 800000)
    assert c.transfer_s(1e6) < c.transfer_s(1e9) < c.transfer_s(1e10)


def test_units_prefill_is_flops_over_rate_and_transfer_bytes_over_bandwidth():
    acc, net = accelerator("H100"), link("roce-400g")
    m = load_model("llama-3-8b")
    c = HardwareCostModel(m, acc, net, Parallelism(1))
    n = 4096
    flops = 2 * m.active_params * n + m.attention_flops(n, 0)
    assert c.prefill_s(n, 0) == pytest.approx(flops / (989e12 * acc.mfu) + acc.step_overhead_s)
    assert c.transfer_s(1e9) == pytest.approx(1e9 / (400e9 / 8 * net.efficiency) + net.overhead_s)
    # decode of one short request on a dense model ~ weights / (bandwidth x MBU)
    assert c.decode_step_s(1, 1) == pytest.approx(m.weight_bytes() / (3.35e12 * acc.mbu) + acc.step_overhead_s,
                                                  rel=1e-3)


def test_parallelism_speeds_up_and_moe_reads_fewer_experts_at_small_batch():
    big, small = _cost("llama-3-70b", tp=8), _cost("llama-3-70b", tp=2)
    assert big.prefill_s(8192, 0) < small.prefill_s(8192, 0)
    assert big.decode_step_s(16, 16000) < small.decode_step_s(16, 16000)
    moe = _cost("qwen3-235b-a22b", tp=8)
    assert moe.decode_step_s(1, 100) < moe.decode_step_s(256, 25600) / 4


def test_capacity_and_fit():
    c = _cost("llama-3-70b", tp=1)
    assert not c.fits() and c.kv_capacity_tokens() == 0
    c2 = _cost("llama-3-70b", tp=2)
    assert c2.fits() and c2.kv_capacity_tokens() > 100_000


def test_catalogue_has_the_required_entries():
    cat = load_catalogue()
    assert {"H100", "H200", "A100", "L40S", "B200"} <= set(cat.accelerators)
    assert {"efa-p5", "efa-p5en", "efa-p6", "roce-400g", "tcp-100g"} <= set(cat.links)


def test_wide_ep_data_parallel_attention_holds_mla_kv_per_rank():
    """MLA's latent is one KV head: every TP rank holds it whole, so TP adds no KV room and DP does; a wide-EP
    worker (tp 1, dp = ep = 8) holds its experts spread like TP 8's and its dense weights whole on every rank."""
    m, acc, net = load_model("deepseek-v3"), accelerator("H200"), link("efa-p5en")
    tp8 = HardwareCostModel(m, acc, net, Parallelism.of(8, 1, m.is_moe))
    dp8 = HardwareCostModel(m, acc, net, Parallelism.of(1, 8, m.is_moe))
    assert tp8.parallel.devices == dp8.parallel.devices == 8 and dp8.parallel.ep == 8
    assert tp8.kv_shards() == 1 and dp8.kv_shards() == 8
    assert dp8.weight_bytes_per_device() > tp8.weight_bytes_per_device()  # dense weights on every DP rank
    assert dp8.kv_capacity_tokens() > 4 * tp8.kv_capacity_tokens()
    # decode reads the dense weights once per DP rank; a prefill runs on one DP rank's share of the devices
    assert dp8.decode_step_s(1, 1000) > tp8.decode_step_s(1, 1000)
    assert dp8.prefill_s(8000) > tp8.prefill_s(8000)
    gqa = HardwareCostModel(load_model("llama-3-70b"), acc, net, Parallelism.of(4, 1, False))
    assert gqa.kv_shards() == 4 and gqa.parallel.ep == 1
