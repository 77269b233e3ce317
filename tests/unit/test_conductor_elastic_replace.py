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


def test_both_role_worker_is_never_decode_of_its_own_prefill():
    """A URL registered as prefill and decode (conductor role "both"): P and D are two workers, and replace_decode
    skips P as well."""
    c = both_pool(3)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "b0", "b1")
    assert c.replace_decode("long") == "b2"


def test_single_both_role_worker_runs_the_request_locally():
    c = both_pool(1)
    d = c.place(req("long", LONG))
    assert (d.kind, d.prefill, d.decode) == ("local", None, "b0")
    assert d.reason == "the prefill worker is the only decode worker"
    assert d.ttft_s == pytest.approx(0.160)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_baselines_never_pair_a_both_role_worker_with_itself(policy):
    c = make(n=0, policy=policy)
    for i in range(2):
        c.add_worker(f"b{i}", "both", 100_000)
    pairs = [(d.prefill, d.decode) for d in (c.place(req(f"r{i}", LONG)) for i in range(4))]
    assert all(p is not None and p != d for p, d in pairs), pairs
    alone = make(n=0, policy=policy)
    alone.add_worker("b0", "both", 100_000)
    d = alone.place(req("r", LONG))
    assert (d.kind, d.decode, d.reason) == ("local", "b0", f"{policy}: the prefill worker is the only decode worker")
