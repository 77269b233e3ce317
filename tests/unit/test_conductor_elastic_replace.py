"""replace_decode in an elastic pool: the new D is never the request's own prefill worker (every elastic worker can
decode, so only an explicit exclusion keeps P out). Cost model as in test_conductor_elastic."""

import pytest

from pdserve.conductor.policy import NoWorker
from tests.unit.test_conductor_elastic import LONG, SHORT, decoding, make, req


def test_replace_decode_never_picks_the_prefill_worker():
    c = make(n=3)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "e0", "e1")
    # e0 (P) runs no decode, so its predicted TPOT ties e2's and its id sorts first: only the exclusion keeps it out
    assert c.replace_decode("long") == "e2"
    assert "long" in c.workers["e2"].decodes and "long" not in c.workers["e0"].decodes
    assert "long" in c.workers["e0"].prefills  # the prefill side is untouched


def test_replace_decode_with_only_the_prefill_worker_left_raises_no_worker():
    c = make(n=2)
    d = c.place(req("long", LONG))
    assert (d.prefill, d.decode) == ("e0", "e1")
    with pytest.raises(NoWorker):
        c.replace_decode("long")  # the router then migrates the whole request
    assert "long" in c.workers["e1"].decodes  # nothing moved: finished() still releases it there
    c.finished("long")
    assert all(not w.prefills and not w.decodes for w in c.workers.values())


def test_replace_decode_of_a_colocated_request_may_use_any_other_worker():
    c = make(n=2)
    decoding(c, "e1", 3)
    d = c.place(req("short", SHORT))
    assert (d.kind, d.decode) == ("local", "e0")
    assert c.replace_decode("short") == "e1"


def both_pool(n: int):
    c = make(n=0, local_prefill_tokens=0)  # 0: the fixed-role conductor never chooses decode-local by size
    for i in range(n):
        c.add_worker(f"b{i}", "both", 100_000)
    return c


def test_both_role_worker_still_hands_off_to_itself_but_replace_decode_skips_it():
    """A URL registered as prefill and decode (conductor role "both", e.g. `--prefill X --decode X`): placement
    keeps the fixed-role behaviour (P -> D through the same worker is a real hand-off, which the single-worker
    PD tests use), but a re-picked D is never P."""
    c = both_pool(1)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "b0", "b0")
    with pytest.raises(NoWorker):
        c.replace_decode("long")
    c = both_pool(3)
    d = c.place(req("long", LONG))
    assert d.kind == "disaggregated" and d.prefill == "b0"
    assert c.replace_decode("long") not in {"b0", d.decode}


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_baselines_pair_a_single_both_role_worker_with_itself(policy):
    alone = make(n=0, policy=policy)
    alone.add_worker("b0", "both", 100_000)
    d = alone.place(req("r", LONG))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "b0", "b0")
