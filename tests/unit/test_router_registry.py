"""The worker registry: one owner of membership, roles and health; listeners (the conductor's placement, the
router) hear of each change when it happens, not on the next request."""

from __future__ import annotations

import pytest

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
from pdserve.router.fleet.placement import ConductorPlacement
from pdserve.router.fleet.registry import WorkerRegistry, role_of
from pdserve.router.workers.client import Worker


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, object]] = []

    def worker_added(self, worker: Worker) -> None:
        self.events.append(("added", worker.url, tuple(sorted(worker.roles))))

    def worker_removed(self, url: str) -> None:
        self.events.append(("removed", url, None))

    def health_changed(self, worker: Worker) -> None:
        self.events.append(("health", worker.url, worker.healthy))


def test_members_roles_and_lookup():
    r = WorkerRegistry([("prefill", "http://a"), ("decode", "http://b"), ("decode", "http://a")])
    assert len(r) == 2 and "http://a" in r and "http://z" not in r
    assert r["http://a"].roles == {"prefill", "decode"} and role_of(r["http://a"].roles) == "both"
    assert [w.url for w in r] == ["http://a", "http://b"]  # membership order
    assert [w.url for w in r.with_role("decode")] == ["http://a", "http://b"]
    assert r.get("http://z") is None
    with pytest.raises(KeyError):
        r["http://z"]


def test_listeners_hear_existing_members_then_each_change():
    r = WorkerRegistry([("prefill", "http://p")])
    log = Log()
    r.subscribe(log)
    assert log.events == [("added", "http://p", ("prefill",))]
    r.add("http://d", "decode")
    assert r.set_health("http://d", False, "unreachable") is True
    assert r.set_health("http://d", False, "unreachable again") is False  # no change, no event
    assert r["http://d"].last_error == "unreachable again" and r.healthy() == [r["http://p"]]
    assert r.set_health("http://d", True) is True and r["http://d"].last_error == ""
    assert r.set_health("http://gone", False) is False
    assert r.remove("http://d") is not None and r.remove("http://d") is None
    assert log.events[1:] == [("added", "http://d", ("decode",)), ("health", "http://d", False),
                              ("health", "http://d", True), ("removed", "http://d", None)]


def test_add_again_gives_a_role_and_revives():
    r = WorkerRegistry([("prefill", "http://a")])
    r.set_health("http://a", False, "down")
    w = r.add("http://a", "decode")
    assert w is r["http://a"] and w.roles == {"prefill", "decode"} and w.healthy and w.last_error == ""


def test_conductor_follows_the_registry_without_per_request_sync():
    r = WorkerRegistry([("prefill", "http://p"), ("decode", "http://d")])
    pl = ConductorPlacement(Conductor(ConductorConfig(policy="round_robin"), OnlineCostModel(0)), r)
    c = pl.conductor
    assert {u: w.role for u, w in c.workers.items()} == {"http://p": "prefill", "http://d": "decode"}
    r.set_health("http://d", False, "probe failed")
    assert c.workers["http://d"].healthy is False  # at once, before any request
    r.add("http://d2", "decode")
    r.add("http://p", "decode")
    assert c.workers["http://d2"].role == "decode" and c.workers["http://p"].role == "both"
    r.remove("http://d2")
    assert "http://d2" not in c.workers
    r.set_health("http://d", True)
    assert c.workers["http://d"].healthy is True
    t = pl.choose([1, 2, 3])
    assert t.decode is r[t.decision.decode]  # the ticket hands out the registry's own workers
    t.close()
