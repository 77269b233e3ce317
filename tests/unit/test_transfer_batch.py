import time

import pytest

from pdserve.transfer import TransferEntry, TransferError, merge_contiguous
from pdserve.transfer.batch import BatchHandle, BatchStatus, Op, split_into_frames, stripe


def E(lo, po, n, lr="a", pr="b"):
    return TransferEntry(lr, lo, pr, po, n)


def test_merge_joins_runs_contiguous_on_both_sides():
    merged = merge_contiguous([E(0, 100, 10), E(10, 110, 5), E(15, 115, 1)])
    assert merged == [E(0, 100, 16)]


def test_merge_keeps_gaps_and_region_changes_apart():
    entries = [E(0, 0, 10), E(10, 20, 10), E(20, 30, 10, lr="c"), E(30, 40, 10, pr="d")]
    assert merge_contiguous(entries) == entries


def test_merge_needs_adjacency_on_the_peer_side_too():
    assert merge_contiguous([E(0, 0, 8), E(8, 100, 8)]) == [E(0, 0, 8), E(8, 100, 8)]


def test_merge_drops_empty_entries_and_keeps_order():
    assert merge_contiguous([E(5, 5, 0), E(64, 0, 4), E(0, 4, 4)]) == [E(64, 0, 4), E(0, 4, 4)]


def test_split_into_frames_covers_every_byte_once_within_slice_size():
    entries = [E(0, 0, 10), E(100, 50, 25), E(200, 300, 3)]
    frames = split_into_frames(entries, 8)
    assert all(sum(e.length for e in f) <= 8 for f in frames)
    pieces = [e for f in frames for e in f]
    assert sum(e.length for e in pieces) == 38
    assert merge_contiguous(pieces) == entries


def test_stripe_deals_frames_round_robin():
    frames = [[E(i, i, 1)] for i in range(5)]
    lanes = stripe(frames, 2)
    assert lanes == [[frames[0], frames[2], frames[4]], [frames[1], frames[3]]]
    assert stripe(frames[:1], 4) == [[frames[0]]]
    assert stripe([], 4) == []


def test_handle_succeeds_once_and_ignores_later_outcomes():
    h = BatchHandle("b1", Op.WRITE, 10, time.monotonic() + 5)
    h.succeed()
    h.fail(TransferError("peer", "late"))
    assert h.wait(0) is BatchStatus.SUCCEEDED
    h.result()


def test_handle_fails_by_its_deadline_and_interrupts_workers():
    h = BatchHandle("b2", Op.WRITE, 10, time.monotonic() + 0.05)
    interrupted = []
    h.add_interrupt(1, lambda: interrupted.append(True))
    t0 = time.monotonic()
    assert h.wait() is BatchStatus.FAILED
    assert time.monotonic() - t0 < 1.0
    assert h.error.code == "deadline" and interrupted == [True]
    with pytest.raises(TransferError, match="deadline"):
        h.result()


def test_abort_ends_the_batch_and_workers_see_it():
    h = BatchHandle("b3", Op.READ, 10, time.monotonic() + 5)
    h.abort()
    assert h.poll() is BatchStatus.ABORTED
    with pytest.raises(TransferError) as info:
        h.remaining()
    assert info.value.code == "aborted"


def test_wait_with_timeout_returns_pending_without_failing():
    h = BatchHandle("b4", Op.WRITE, 10, time.monotonic() + 5)
    assert h.wait(0.01) is BatchStatus.PENDING
    with pytest.raises(TimeoutError):
        h.result(0.01)


def test_merge_columns_equals_merge_contiguous_on_random_batches():
    import random

    from pdserve.transfer.batch import merge_columns

    rng = random.Random(0)
    lengths = {"a": 1 << 30, "b": 1 << 20}
    for trial in range(200):
        rows, lo, po = [], 0, 0
        for _ in range(rng.randint(64, 300)):
            n = rng.choice([0, 16, 4096, 4096])
            if rng.random() < 0.3:
                lo = rng.randrange(1000) * 16
            if rng.random() < 0.3:
                po = rng.randrange(1000) * 16
            rows.append((rng.choice("ab"), lo, rng.choice("ab"), po, n))
            lo, po = lo + n, po + n
        got = merge_columns(rows, lengths.__getitem__, lengths.__getitem__)
        assert got == merge_contiguous([TransferEntry(*r) for r in rows]), trial
        assert all(type(e) is TransferEntry for e in got)
    ok = [("a", 0, "b", 0, 16)] * 70
    for bad in (ok + [("a", 0, "b", (1 << 20) - 8, 16)], ok + [("a", -1, "b", 0, 16)], ok + [("a", 0.5, "b", 0, 1)],
                ok + [("a", 0, "b", 0)], ok + [("a", 0, "b", 0, 1 << 70)]):
        assert merge_columns(bad, lengths.__getitem__, lengths.__getitem__) is None  # the per-entry path says why
