"""Membership shared by router replicas through one file (:mod:`pdserve.router.fleet.shared_membership`): a change
on one replica reaches the other at its next poll, a restarted replica takes the file's set rather than its argv,
KV event publishers travel with the workers, and concurrent writers both land."""

from __future__ import annotations

import threading

from pdserve.router.fleet.kv_events import Publisher
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.fleet.shared_membership import MembershipFile

P, D, NEW = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def replica(path, members=(("prefill", P), ("decode", D))) -> tuple[WorkerRegistry, dict, MembershipFile]:
    reg = WorkerRegistry(members)
    pubs: dict[str, Publisher] = {}
    shared = MembershipFile(path, reg, pubs)
    shared.start()
    return reg, pubs, shared


def test_a_change_on_one_replica_reaches_the_other_and_a_restart(tmp_path):
    path = tmp_path / "membership.json"
    reg_a, pubs_a, a = replica(path)
    reg_b, pubs_b, b = replica(path)
    pubs_a[NEW] = Publisher("ipc:///tmp/x.kvpub", "ipc:///tmp/x.kvrpl")
    reg_a.add(NEW, "decode")
    a.changed(NEW)
    assert not a.poll()  # its own write
    assert b.poll() and NEW in reg_b and reg_b[NEW].roles == {"decode"}
    assert pubs_b[NEW] == Publisher("ipc:///tmp/x.kvpub", "ipc:///tmp/x.kvrpl")
    assert not b.poll()  # nothing new
    reg_b.remove(P)
    b.changed(P)
    assert a.poll() and P not in reg_a and sorted(w.url for w in reg_a) == [D, NEW]
    # a replica restarted with the launch's argv gets the current set, not its argv
    reg_c, pubs_c, _ = replica(path)
    assert sorted(w.url for w in reg_c) == [D, NEW] and pubs_c[NEW].endpoint == "ipc:///tmp/x.kvpub"


def test_roles_are_added_and_elastic_stays_whole(tmp_path):
    path = tmp_path / "m.json"
    reg_a, _, a = replica(path, ())
    reg_b, _, b = replica(path, ())
    reg_a.add(NEW, "elastic")
    a.changed(NEW)
    reg_a.add(P, "prefill")
    a.changed(P)
    reg_a.add(P, "decode")
    a.changed(P)
    assert b.poll()
    assert reg_b[NEW].roles == reg_a[NEW].roles and reg_b[P].roles == {"prefill", "decode"}


def test_concurrent_writers_both_land(tmp_path):
    path = tmp_path / "m.json"
    regs = [replica(path, ()) for _ in range(2)]
    urls = [[f"http://127.0.0.1:{10000 + 100 * i + j}" for j in range(20)] for i in range(2)]

    def add(i: int) -> None:
        reg, _, shared = regs[i]
        for u in urls[i]:
            reg.add(u, "decode")
            shared.changed(u)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh, _, _ = replica(path, ())
    assert sorted(w.url for w in fresh) == sorted(urls[0] + urls[1])
