"""pdserve.vllm.release.ReleaseLedger: when a finished request's held blocks are freed, counted once.

Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

import threading

from pdserve.vllm.release import ReleaseLedger


def test_notified_lease_released_once_and_counted_once():
    ledger = ReleaseLedger()
    ledger.lease("a", deadline=100.0)
    ledger.lease("b", deadline=100.0)
    out = ledger.step(now=50.0)
    assert out.finished_sending == set() and out.lease_ends == {}
    ledger.notify("a", now=51.0)
    out = ledger.step(now=52.0)
    assert out.finished_sending == {"a"} and out.lease_ends == {"a": "notified"}
    ledger.notify("a", now=53.0)  # late duplicate: never released again
    out = ledger.step(now=101.0)
    assert out.finished_sending == {"b"} and out.lease_ends == {"b": "lease"}
    out = ledger.step(now=102.0)
    assert out.finished_sending == set() and out.lease_ends == {}
    assert ledger.take_counts() == {"notified": 1, "lease": 1}
    assert ledger.take_counts() == {"notified": 0, "lease": 0}
    assert ledger.held() == set()


def test_lease_expires_at_its_deadline_not_before():
    ledger = ReleaseLedger()
    ledger.lease("x", deadline=10.0)
    assert ledger.step(now=9.999).finished_sending == set()
    out = ledger.step(now=10.0)
    assert out.finished_sending == {"x"} and out.lease_ends == {"x": "lease"}
    ledger.notify("x", now=11.0)  # D reads after the lease: nothing more to free
    assert ledger.step(now=12.0).finished_sending == set()
    assert ledger.take_counts() == {"notified": 0, "lease": 1}


def test_repeated_lease_keeps_the_first_deadline():
    ledger = ReleaseLedger()
    ledger.lease("x", deadline=10.0)
    ledger.lease("x", deadline=50.0)
    assert ledger.step(now=10.0).finished_sending == {"x"}


def test_notification_wins_over_expiry_in_the_same_step():
    ledger = ReleaseLedger()
    ledger.lease("x", deadline=10.0)
    ledger.notify("x", now=9.0)
    assert ledger.step(now=20.0).lease_ends == {"x": "notified"}
    assert ledger.take_counts() == {"notified": 1, "lease": 0}


def test_early_notification_applies_when_the_lease_arrives():
    ledger = ReleaseLedger(early_ttl_s=10.0)
    ledger.notify("x", now=1.0)  # D read before P's worker learned of the request
    assert ledger.step(now=1.5).finished_sending == set()
    ledger.lease("x", deadline=100.0)
    out = ledger.step(now=2.0)
    assert out.finished_sending == {"x"} and out.lease_ends == {"x": "notified"}
    ledger.notify("y", now=3.0)
    ledger.step(now=20.0)  # stale early note dropped: a lease arriving later runs to its deadline
    ledger.lease("y", deadline=30.0)
    assert ledger.step(now=21.0).finished_sending == set()
    assert ledger.step(now=30.0).lease_ends == {"y": "lease"}


def test_unknown_ids_are_never_reported():
    ledger = ReleaseLedger()
    ledger.notify("ghost", now=1.0)
    ledger.save_done("ghost")
    out = ledger.step(now=2.0)
    assert out.finished_sending == set() and out.lease_ends == {}
    assert ledger.take_counts() == {"notified": 0, "lease": 0}
    assert ledger.held() == set()


def test_notified_before_save_done_waits_for_the_save():
    ledger = ReleaseLedger()
    ledger.lease("p", deadline=100.0)
    ledger.saving("p")
    ledger.notify("p", now=1.0)
    out = ledger.step(now=2.0)  # the lease ended (counted now) but the save still reads the blocks
    assert out.finished_sending == set() and out.lease_ends == {"p": "notified"}
    assert ledger.held() == {"p"}
    out = ledger.step(now=3.0)
    assert out.finished_sending == set() and out.lease_ends == {}
    ledger.save_done("p")
    out = ledger.step(now=4.0)
    assert out.finished_sending == {"p"} and out.lease_ends == {}
    assert ledger.take_counts() == {"notified": 1, "lease": 0}


def test_save_done_before_notify_leaves_the_release_to_the_lease():
    ledger = ReleaseLedger()
    ledger.lease("r", deadline=100.0)
    ledger.saving("r")
    ledger.save_done("r")
    assert ledger.step(now=2.0).finished_sending == set()
    ledger.notify("r", now=3.0)
    out = ledger.step(now=4.0)
    assert out.finished_sending == {"r"} and out.lease_ends == {"r": "notified"}


def test_lease_expiry_during_a_save_waits_for_the_save():
    ledger = ReleaseLedger()
    ledger.lease("e", deadline=5.0)
    ledger.saving("e")
    out = ledger.step(now=6.0)
    assert out.finished_sending == set() and out.lease_ends == {"e": "lease"}
    ledger.save_done("e")
    assert ledger.step(now=7.0).finished_sending == {"e"}
    assert ledger.take_counts() == {"notified": 0, "lease": 1}


def test_save_only_request_released_when_its_save_ends():
    ledger = ReleaseLedger()
    ledger.saving("q")
    assert ledger.step(now=1.0).finished_sending == set()
    ledger.notify("q", now=1.5)  # not leased: kept as an early note, does not free the blocks
    assert ledger.step(now=1.6).finished_sending == set()
    ledger.save_done("q")
    out = ledger.step(now=2.0)
    assert out.finished_sending == {"q"} and out.lease_ends == {}
    assert ledger.take_counts() == {"notified": 0, "lease": 0}


def test_notify_and_save_done_in_the_same_step():
    ledger = ReleaseLedger()
    ledger.lease("s", deadline=100.0)
    ledger.saving("s")
    ledger.notify("s", now=1.0)
    ledger.save_done("s")
    out = ledger.step(now=2.0)
    assert out.finished_sending == {"s"} and out.lease_ends == {"s": "notified"}
    assert ledger.held() == set()


def test_notifications_from_another_thread_each_end_one_lease():
    ledger = ReleaseLedger()
    ids = [f"r{i}" for i in range(200)]
    for r in ids:
        ledger.lease(r, deadline=1e12)
    threads = [threading.Thread(target=lambda part=ids[i::4]: [ledger.notify(r) for r in part]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in ids[:50]:
        ledger.notify(r)  # duplicates
    out = ledger.step()
    assert out.finished_sending == set(ids) and set(out.lease_ends.values()) == {"notified"}
    assert ledger.take_counts() == {"notified": 200, "lease": 0}
