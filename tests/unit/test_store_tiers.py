"""Arena allocator (first fit, coalescing, reserve) and the SSD tier (real files, its own bound)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.store.tiers import ALIGN, ArenaAllocator, DiskTier


def test_first_fit_and_alignment() -> None:
    a = ArenaAllocator(1024)
    assert a.alloc(10) == 0
    assert a.alloc(64) == ALIGN
    assert a.alloc(65) == 2 * ALIGN
    assert a.used == 4 * ALIGN
    assert a.free_ranges() == [(4 * ALIGN, 1024)]


def test_free_coalesces_both_sides_and_reuses_lowest_hole() -> None:
    a = ArenaAllocator(64 * 10)
    offs = [a.alloc(64) for _ in range(10)]
    assert offs == [64 * i for i in range(10)]
    assert a.alloc(1) is None
    a.free(64, 64)
    a.free(192, 64)
    assert a.free_ranges() == [(64, 128), (192, 256)]
    a.free(128, 64)  # bridges the two holes
    assert a.free_ranges() == [(64, 256)]
    assert a.alloc(100) == 64  # first fit: lowest hole
    assert a.alloc(64) == 192
    with pytest.raises(ValueError):
        a.free(0, 64) or a.free(0, 64)  # double free


def test_random_alloc_free_never_overlaps_and_returns_to_one_range() -> None:
    rng = random.Random(0)
    a = ArenaAllocator(1 << 16)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.randint(1, 3000)
            off = a.alloc(size)
            if off is not None:
                end = off + size
                assert all(end <= o or off >= o + s for o, s in live.items())
                live[off] = size
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.used == 0 and a.free_ranges() == [(0, 1 << 16)]


def test_reserve_marks_known_ranges_and_refuses_taken_ones() -> None:
    a = ArenaAllocator(4096)
    assert a.reserve(1024, 100)
    assert not a.reserve(1024, 64)  # already taken
    assert not a.reserve(1000, 64)  # misaligned
    assert a.alloc(1024) == 0
    assert a.alloc(64) == 1024 + 128


def test_disk_tier_roundtrip_bound_and_rescan(tmp_path) -> None:
    d = DiskTier(tmp_path, capacity=10_000)
    data = np.arange(4000, dtype=np.uint8)
    d.write(7, memoryview(data))
    d.write(8, memoryview(data))
    assert d.used == 8000 and (tmp_path / f"{7:016x}.kv").stat().st_size == 4000
    with pytest.raises(OSError, match="full"):
        d.write(9, memoryview(data))
    out = np.zeros(4000, dtype=np.uint8)
    assert d.read_into(8, memoryview(out)) == 4000 and np.array_equal(out, data)
    with pytest.raises(OSError, match="expected"):
        d.read_into(8, memoryview(np.zeros(10, dtype=np.uint8)))
    d.remove(7)
    assert 7 not in d and not (tmp_path / f"{7:016x}.kv").exists()
    again = DiskTier(tmp_path, capacity=10_000)  # a restarted node finds its objects
    assert dict(again.scan()) == {8: 4000}
