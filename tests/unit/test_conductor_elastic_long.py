"""The elastic "long" rule and the stall-weighted harm (pdserve.conductor.elastic). Cost model as in
test_conductor_elastic: 1 ms per new prompt token, decode step 10 ms + 1 ms per sequence, 50 ms hand-off, 1 GB/s
for 1000 B/token (a 96-token prompt's KV moves in 0.096 ms), ``local_stall_s`` 50 ms; ``split_harm_handoffs`` 2 where
a test says so (``make2``), else the default 1.

A prefill is long on w when it stretches the decodes' gap past the target (or stalls them over ``local_stall_s``)
AND its harm (prefill x inflation-weighted decodes) is over ``split_harm_handoffs`` hand-offs; on an idle worker
it is judged next to one fresh decode."""

import pytest

from pdserve.conductor import ConductorConfig, ConductorConfigError
from pdserve.conductor.elastic import gap_over, handoff_cost_s, inflation, is_long, long_on, prefill_on, prefilling_long
from tests.unit.test_conductor_elastic import LONG, decoding, make, req

P96 = list(range(3000, 3096))  # 96 ms: over the 50 ms stall limit, under two hand-offs (100.2 ms) next to 1 decode


def make2(**cfg):
    """A two-hand-off margin: a 96 ms prefill next to one decode (harm 96 ms < 100.2 ms) stays short."""
    return make(split_harm_handoffs=2.0, **cfg)


def shape(c, worker, tokens):
    """The Prefill a prompt of ``tokens`` would have on ``worker`` now."""
    return prefill_on(c, c.prefill_options(req("x", tokens), [c.workers[worker]], {}, c.clock())[0])


def test_default_splits_a_prompt_whose_stall_costs_one_decode_more_than_a_hand_off():
    c = make()
    decoding(c, "e0", 1)
    decoding(c, "e1", 1)
    assert c.config.split_harm_handoffs == 1.0
    assert long_on(c, shape(c, "e0", P96))  # 96 ms > 50 ms stall limit, 96 ms > 50.1 ms hand-off
    d = c.place(req("p", P96))
    assert (d.kind, d.placement, d.prefill, d.decode) == ("disaggregated", "split", "e0", "e1")
    assert "(long)" in d.reason


def test_two_hand_off_margin_keeps_it_colocated_next_to_one_decode():
    """On one CPU core a 100-token prefill (~0.1 s) is longer than the 50 ms stall limit and than one hand-off:
    the default splits it. With a two-hand-off margin one decode's harm (96 ms) is under 100.2 ms: colocated."""
    c = make2()
    decoding(c, "e0", 1)
    decoding(c, "e1", 1)
    s = shape(c, "e0", P96)
    assert (s.stall_s, s.step_s, s.harm_s) == (pytest.approx(0.096), pytest.approx(0.107), pytest.approx(0.096))
    assert handoff_cost_s(c, 96, 0) == pytest.approx(0.050096)
    assert gap_over(c, s.stall_s, s.step_s) and not long_on(c, s)
    d = c.place(req("p", P96))
    assert (d.kind, d.placement, d.decode) == ("local", "colocated", "e0")
    assert "(short)" in d.reason


def test_the_same_prompt_next_to_two_decodes_splits_even_with_the_margin():
    c = make2()
    decoding(c, "e0", 2)
    decoding(c, "e1", 2)
    s = shape(c, "e0", P96)
    assert s.harm_s == pytest.approx(0.192) and long_on(c, s)  # 2 x 96 ms > 2 x 50.1 ms
    d = c.place(req("p", P96))
    assert (d.kind, d.placement, d.prefill, d.decode) == ("disaggregated", "split", "e0", "e1")
    assert "(long)" in d.reason


def test_a_tpot_target_replaces_the_stall_limit_in_the_gap_test():
    """With a 200 ms target the decodes' step with the 96 ms prefill (12 + 96 ms) keeps under it: short, even next
    to two decodes whose harm is over two hand-offs."""
    c = make(tpot_slo_s=0.2)
    decoding(c, "e0", 2)
    decoding(c, "e1", 2)
    s = shape(c, "e0", P96)
    assert s.step_s == pytest.approx(0.108) and not gap_over(c, s.stall_s, s.step_s) and not long_on(c, s)
    assert c.place(req("p", P96)).placement == "colocated"
    c2 = make(tpot_slo_s=0.1)
    assert gap_over(c2, 0.096, 0.108) and not gap_over(c2, 0.5, 0.1)  # the step, not the stall, meets T


def test_idle_worker_judges_the_prompt_next_to_one_fresh_decode():
    assert not is_long(make(), 50, 0) and is_long(make(), 51, 0)  # the 50 ms stall limit binds first
    c = make2()
    assert not is_long(c, 100, 0) and is_long(c, 101, 0)  # 2 x (50 + 0.1) ms hand-off = 100.2 ms
    d = c.place(req("p", list(range(5000, 5100))))  # 100 tokens: colocated on the idle e0
    assert (d.kind, d.decode) == ("local", "e0")
    assert make().place(req("p", list(range(5000, 5100)))).placement == "split"  # the default splits it
    c = make2()
    d = c.place(req("long", LONG))  # 160 ms: long even on an idle pool, so e0 stays free of decodes
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "e0", "e1")


def test_split_harm_handoffs_is_validated():
    assert not is_long(make(split_harm_handoffs=4.0), 160, 0)  # 160 ms < 4 x 50.16 ms
    for bad in (0, -1.0, True, "2", None):
        with pytest.raises(ConductorConfigError, match="split_harm_handoffs"):
            ConductorConfig(split_harm_handoffs=bad)


def test_local_prefill_tokens_overrides_the_rule_everywhere():
    c = make(local_prefill_tokens=90)
    decoding(c, "e0", 1)
    assert long_on(c, shape(c, "e0", P96)) and long_on(c, shape(c, "e1", P96))  # 96 > 90, idle or not
    assert not is_long(c, 90, 0) and is_long(c, 91, 0, running=0)


def test_placing_a_prefill_charges_its_stall_to_the_decodes_it_slows():
    c = make2()
    decoding(c, "e0", 2)
    decoding(c, "e1", 1)
    d = c.place(req("p", P96))  # least harm on e1 (1 decode, 96 ms < 100.2 ms: short): colocated there
    assert (d.kind, d.decode) == ("local", "e1")
    assert c.workers["e1"].decodes["e1-run0"].stalled_s == pytest.approx(0.096)
    assert c.workers["e1"].decodes["p"].stalled_s == 0.0  # its own decode waits for it, it is not slowed by it
    assert all(j.stalled_s == 0.0 for j in c.workers["e0"].decodes.values())
    rej = make2(ttft_slo_s=0.01)
    assert rej.place(req("p", P96)).kind == "reject"  # nothing placed, nothing charged
    assert all(not w.decodes for w in rej.workers.values())


def test_a_chunked_prefill_charges_every_chunk():
    c = make(chunk_tokens=32)
    decoding(c, "e0", 2)
    decoding(c, "e1", 2)
    s = shape(c, "e0", P96)
    assert (s.steps, s.total_stall_s) == (4, pytest.approx(4 * 0.030))
    c.place(req("p", P96))
    assert [j.stalled_s for j in c.workers["e0"].decodes.values() if j.request_id != "p"] == \
        [pytest.approx(0.120)] * 2


def test_inflation_weighs_decodes_already_stalled():
    """Each decode counts 1 + stalled / (gaps x step): a decode with 100 gaps at 12 ms (1.2 s of plain decode) that
    already took 1.2 s of stalls counts 2."""
    c = make()
    decoding(c, "e0", 2)
    assert inflation(c.workers["e0"], 0.012) == pytest.approx(2.0)
    for j in c.workers["e0"].decodes.values():
        j.stalled_s = 1.2
    assert inflation(c.workers["e0"], 0.012) == pytest.approx(4.0)
    assert inflation(c.workers["e0"], 0.0) == 2.0  # no step predicted: each decode counts 1
    assert shape(c, "e0", LONG).harm_s == pytest.approx(0.160 * 4)


def test_the_next_long_prefill_spares_decodes_that_already_took_one():
    """e0's two decodes already absorbed 1.2 s of stalls each (weight 4 in all), e1 runs three fresh ones (weight
    3): the long prefill goes to e1, though it runs more decodes (counted plainly, e0 would win: 2 < 3)."""
    c = make()
    decoding(c, "e0", 2)
    decoding(c, "e1", 3)
    for j in c.workers["e0"].decodes.values():
        j.stalled_s = 1.2
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "e1", "e0")
    assert all(j.stalled_s == pytest.approx(0.160) for j in c.workers["e1"].decodes.values())
    fresh = make()
    decoding(fresh, "e0", 2)
    decoding(fresh, "e1", 3)
    assert fresh.place(req("long", LONG)).prefill == "e0"


def test_prefilling_long_counts_the_new_decode_next_to_the_others():
    c = make2()
    c.place(req("p", P96))  # colocated on idle e0: next to one fresh decode, 96 ms < 100.2 ms: short
    assert not prefilling_long(c, c.workers["e0"])
    decoding(c, "e0", 1)  # now one more decode there: 2 x 96 ms > 100.2 ms
    assert prefilling_long(c, c.workers["e0"])
