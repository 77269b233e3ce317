"""pdserve.kube.discovery when a pod restarts (the Kubernetes side of supervision), with the fake router and DNS of
test_helm_discovery: a worker that leaves DNS while it restarts is removed, and added back when it resolves
again, under the same or a new address; removing it ourselves never tombstones it."""

from __future__ import annotations

from tests.unit.test_helm_discovery import FakeDns, FakeRouter, make, u


def test_a_pod_that_restarts_in_place_is_removed_then_re_added_without_a_tombstone():
    router, dns = FakeRouter(), FakeDns()
    dns.answers = {"pd-prefill.ns.svc": {"10.0.0.1"}, "pd-decode.ns.svc": {"10.0.1.1"}}
    rec, clock = make(router, dns, absent_rounds=2, tombstone_s=300)
    assert len(rec.step().added) == 2
    dns.answers["pd-decode.ns.svc"] = set()  # container restarting: not ready, out of the Service
    assert rec.step().removed == []
    res = rec.step()
    assert res.removed == [u("10.0.1.1")] and res.tombstoned == []
    clock.t += 5
    assert not rec.step().changed  # still restarting
    dns.answers["pd-decode.ns.svc"] = {"10.0.1.1"}  # ready again, same IP
    res = rec.step()
    assert res.added == [(u("10.0.1.1"), "decode")] and res.tombstoned == []
    assert router.members == {u("10.0.0.1"): {"prefill"}, u("10.0.1.1"): {"decode"}}


def test_a_pod_rescheduled_under_a_new_ip_replaces_the_old_member():
    router, dns = FakeRouter(), FakeDns()
    dns.answers = {"pd-prefill.ns.svc": {"10.0.0.1"}, "pd-decode.ns.svc": {"10.0.1.1"}}
    rec, _ = make(router, dns, absent_rounds=2)
    rec.step()
    dns.answers["pd-prefill.ns.svc"] = {"10.0.0.9"}
    res = rec.step()
    assert res.added == [(u("10.0.0.9"), "prefill")] and res.removed == []  # serve on the new one at once
    res = rec.step()
    assert res.removed == [u("10.0.0.1")]
    assert router.members == {u("10.0.0.9"): {"prefill"}, u("10.0.1.1"): {"decode"}}


def test_a_restarted_router_gets_every_worker_back():
    """The router is supervised too (a Deployment): restarted, it knows only its bootstrap members, or none."""
    router, dns = FakeRouter(), FakeDns()
    dns.answers = {"pd-prefill.ns.svc": {"10.0.0.1"}, "pd-decode.ns.svc": {"10.0.1.1", "10.0.1.2"}}
    rec, _ = make(router, dns)
    rec.step()
    router.members.clear()  # the router process restarted with no members
    res = rec.step()
    assert sorted(res.added) == [(u("10.0.0.1"), "prefill"), (u("10.0.1.1"), "decode"), (u("10.0.1.2"), "decode")]
    assert res.tombstoned == []
