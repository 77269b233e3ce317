"""A request that must run whole on one worker (``PlacementRequest.whole``: beam search, run/beam_search.py) goes to
a worker that decodes, under every policy; a prefill worker takes it only when no decoder is live."""

import pytest

from pdserve.conductor import Conductor, ConductorConfig, PlacementRequest
from pdserve.conductor.policy import NoWorker

from .fake_clock import Clock
from .test_conductor_policy import cost


def make(policy: str, roles: dict[str, str], **cfg) -> Conductor:
    c = Conductor(ConductorConfig(block_size=16, policy=policy, **cfg), cost(), Clock())
    for wid, role in roles.items():
        c.add_worker(wid, role, 0 if role == "prefill" else 100_000)
    return c


def whole(rid: str = "r") -> PlacementRequest:
    return PlacementRequest(rid, 40, (), 8, whole=True)


@pytest.mark.parametrize("policy", ["conductor", "round_robin", "least_loaded"])
def test_whole_goes_to_a_decode_worker(policy):
    c = make(policy, {"p0": "prefill", "p1": "prefill", "d0": "decode"})
    d = c.place(whole())
    assert (d.kind, d.prefill, d.decode) == ("local", None, "d0")
    assert c.place(PlacementRequest("split", 40, (), 8)).kind == "disaggregated"  # the flag alone decides


def test_whole_spreads_over_decoders_and_releases():
    c = make("round_robin", {"p0": "prefill", "d0": "decode", "d1": "decode"})
    assert {c.place(whole("a")).decode, c.place(whole("b")).decode} == {"d0", "d1"}
    c.finished("a")
    c.finished("b")
    assert not c.workers["d0"].decodes and not c.workers["d1"].decodes


def test_whole_on_colocated_and_elastic_workers():
    assert make("conductor", {"w0": "colocated"}).place(whole()).decode == "w0"
    assert make("conductor", {"e0": "elastic", "e1": "elastic"}).place(whole()).kind == "local"


def test_whole_falls_back_to_prefill_worker_then_none():
    c = make("conductor", {"p0": "prefill", "d0": "decode"})
    d = c.place(PlacementRequest("r", 40, (), 8, whole=True), exclude=frozenset({"d0"}))
    assert (d.kind, d.decode) == ("local", "p0")
    with pytest.raises(NoWorker):
        c.place(whole("x"), exclude=frozenset({"d0", "p0"}))


def test_whole_rejected_when_every_decoder_is_full():
    c = make("conductor", {"p0": "prefill", "d0": "decode"}, max_inflight_per_worker=1)
    assert c.place(whole("a")).decode == "d0"
    d = c.place(whole("b"))
    assert (d.kind, d.code) == ("reject", "worker_limit")
