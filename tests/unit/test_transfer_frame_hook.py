"""Issue 27, checking a read while it lands: the hook of a READ submitted with ``on_frame`` sees every byte once,
after it is in local memory and before the batch's notification is sent. tcp moves the same frames as without a
hook and reports them in pieces as they land (each lane's last pieces halving to a small tail); the same-host path
reports each piece it copied itself under the owner's grant, or (without a grant) each frame as the owner answers
it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pdserve.transfer import TransferConfig, TransferEngine
from pdserve.transfer.batch import TransferEntry, cut_frames, merge_contiguous, taper_sizes

SECRET = "0123456789abcdef-frame-hook"
MiB = 1 << 20


def E(lo, po, n):
    return TransferEntry("a", lo, "b", po, n)


def test_taper_sizes_halve_towards_a_small_tail_and_cover_the_total():
    assert taper_sizes(16 * MiB, 16 * MiB, 256 << 10)[-3:] == [512 << 10, 256 << 10, 256 << 10]
    for total in (1, 1000, MiB, 16 * MiB + 3, 300 * MiB):
        sizes = taper_sizes(total, 4 * MiB, 256 << 10)
        assert sum(sizes) == total and max(sizes) <= 4 * MiB and sizes[-1] <= 256 << 10
        assert all(a >= b or a == sizes[0] for a, b in zip(sizes, sizes[1:]))


def test_cut_frames_cuts_entries_into_consecutive_sizes():
    assert cut_frames([E(0, 0, 10)], iter([4, 4])) == [[E(0, 0, 4)], [E(4, 4, 4)], [E(8, 8, 2)]]
    entries = [E(i * 4096, 10 * i * 4096, 4096) for i in range(100)]  # gaps on the peer side: no merges
    frames = cut_frames(entries, taper_sizes(100 * 4096, 64 << 10, 8192))
    assert merge_contiguous([e for f in frames for e in f]) == entries
    assert [sum(e.length for e in f) for f in frames][-3:] == [16384, 8192, 8192]


@pytest.mark.parametrize("backend", ["tcp", "local", "local-owner"])
def test_on_frame_sees_every_frame_landed_before_the_notification(backend):
    """local: the reader copies under the owner's grant, in pieces of piece_bytes; local-owner (no grant taken):
    the owner copies each frame on request."""
    conf = TransferConfig(secret=SECRET, slice_bytes=MiB, local_slice_bytes=MiB, piece_bytes=256 << 10,
                          tail_slice_bytes=64 << 10, local_direct=backend != "local-owner")
    backend = backend.split("-")[0]
    owner, reader = TransferEngine(conf), TransferEngine(conf)
    try:
        src = np.random.default_rng(0).integers(0, 255, 8 * MiB, dtype=np.uint8)
        dst = np.zeros(8 * MiB, dtype=np.uint8)
        owner.register("mem", src)
        reader.register("dst", dst)
        order: list[str] = []
        owner.on_notify(lambda note: order.append("notify"))
        frames: list[list[TransferEntry]] = []
        lock = threading.Lock()

        def hook(frame):
            for e in frame:  # its bytes are in already
                assert np.array_equal(dst[e.local_offset:e.local_offset + e.length],
                                      src[e.peer_offset:e.peer_offset + e.length])
            with lock:
                frames.append(frame)
                order.append("frame")

        peer = reader.fetch_segment(owner.segment().host, owner.segment().port)
        entries = [("dst", i * 65536, "mem", (127 - i) * 65536, 65536) for i in range(128)]  # reversed: no merges
        handle = reader.submit(peer, entries, "read", notify="n", backend=backend, on_frame=hook)
        handle.result()
        assert np.array_equal(dst.reshape(128, -1), src.reshape(128, -1)[::-1])
        landed = sorted((e for f in frames for e in f), key=lambda e: e.local_offset)
        assert merge_contiguous(landed) == sorted(TransferEntry(*e) for e in entries)  # every byte, once
        sizes = [sum(e.length for e in f) for f in frames]
        if backend == "tcp":  # pieces of the same 1 MiB frames, each lane's last ones halving to 64 KiB
            assert max(sizes) <= 256 << 10 and sizes.count(64 << 10) >= 2 * conf.streams
        elif conf.local_direct:  # the reader's own copies, a piece at a time
            assert sizes == [256 << 10] * 32
        else:  # the owner's frames, as without a hook
            assert sizes == [MiB] * 8
        assert order[-1] == "notify" and order.count("notify") == 1
        plain = reader.submit(peer, entries, "read", backend=backend)  # no hook: frames as before
        plain.result()
    finally:
        owner.close()
        reader.close()
