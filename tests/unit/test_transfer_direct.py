"""Same-host direct copies (pdserve.transfer.direct): the initiator copies under the owner's grant, checks every
range against the owner's live region table (never the caller's descriptor), fetches a new grant once the owner
unregistered a region, refuses a grant whose pid does not hold the owner's token, and falls back to the owner's
copies when the owner gives no grant. Two engines in this process: the kernel's cross-process copy works on our
own pid too."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdserve.transfer import BatchStatus, TransferConfig, TransferEngine, TransferError, direct
from pdserve.transfer.batch import TransferEntry
from pdserve.transfer.regions import RegionTable

SECRET = "0123456789abcdef-direct-copies"
MiB = 1 << 20


@pytest.fixture
def pair():
    owner, reader = TransferEngine(TransferConfig(secret=SECRET)), TransferEngine(TransferConfig(secret=SECRET))
    mem = np.random.default_rng(1).integers(0, 255, 4 * MiB, dtype=np.uint8)
    mine = np.random.default_rng(2).integers(0, 255, 4 * MiB, dtype=np.uint8)
    owner.register("mem", mem)
    reader.register("mine", mine)
    owner.mem, reader.mine = mem, mine
    peer = reader.fetch_segment(owner.segment().host, owner.segment().port)
    yield owner, reader, peer
    owner.close()
    reader.close()


def served(engine: TransferEngine) -> list[str]:
    """Copy requests the owner served itself (its 'lw'/'lr' handlers), counted by wrapping them."""
    calls: list[str] = []
    for kind in ("lw", "lr"):
        inner = engine._server.handlers[kind]
        engine._server.handlers[kind] = lambda ctx, msg, inner=inner, kind=kind: (calls.append(kind),
                                                                                  inner(ctx, msg))[1]
    return calls


def test_reads_and_writes_land_byte_exact_without_the_owner_copying(pair):
    owner, reader, peer = pair
    calls = served(owner)
    entries = [("mine", i * 4096, "mem", (99 - i) * 8192 + 3, 4096) for i in range(100)]  # no merges
    reader.submit(peer, entries, "write", backend="local").result(10)
    for lo, _, po, n in ((e[1], e[2], e[3], e[4]) for e in entries):
        assert np.array_equal(owner.mem[po:po + n], reader.mine[lo:lo + n])
    owner.mem[:MiB] = 7
    reader.submit(peer, [("mine", 2 * MiB, "mem", 0, MiB)], "read", backend="local").result(10)
    assert (reader.mine[2 * MiB:3 * MiB] == 7).all()
    assert calls == []  # the reader copied; the owner only gave its grant


def test_ranges_are_checked_against_the_owners_table_not_the_callers_descriptor(pair):
    owner, reader, peer = pair
    before = owner.mem.copy()
    forged = dict(peer.to_wire(), regions={"mem": [owner.mem.ctypes.data, 64 * MiB], "ghost": [0, MiB]})
    for entries, code in (([("mine", 0, "mem", 4 * MiB - 100, 4096)], "bounds"),
                          ([("mine", 0, "mem", i * 4096, 4096) for i in range(40)] + [("mine", 0, "mem", 5 * MiB, 1)],
                           "bounds"),
                          ([("mine", 0, "ghost", 0, 16)], "unknown_region")):
        h = reader.submit(forged, entries, "write", backend="local")
        assert h.wait(10) is BatchStatus.FAILED and h.error.code == code
    assert np.array_equal(owner.mem, before)


def test_a_region_unregistered_by_the_owner_invalidates_the_grant(pair):
    owner, reader, peer = pair
    extra = np.zeros(MiB, dtype=np.uint8)
    owner.register("extra", extra)
    peer = reader.fetch_segment(peer.host, peer.port)
    reader.submit(peer, [("mine", 0, "extra", 0, 4096)], "write", backend="local").result(10)
    assert np.array_equal(extra[:4096], reader.mine[:4096])
    owner.unregister("extra")
    h = reader.submit(peer, [("mine", 0, "extra", 0, 4096)], "write", backend="local")  # a stale descriptor
    assert h.wait(10) is BatchStatus.FAILED and h.error.code == "unknown_region"
    reader.submit(peer, [("mine", 0, "mem", 0, 4096)], "write", backend="local").result(10)  # the rest goes on


def test_an_owner_that_gives_no_grant_copies_for_us(pair):
    owner, reader, peer = pair
    del owner._server.handlers["lgrant"]  # as an engine from before direct copies
    calls = served(owner)
    reader.submit(peer, [("mine", 0, "mem", 0, MiB)], "write", backend="local").result(10)
    assert np.array_equal(owner.mem[:MiB], reader.mine[:MiB]) and calls == ["lw"]


def test_a_grant_whose_pid_lacks_the_owners_token_is_refused():
    issuer = direct.GrantIssuer()  # alive through the test: its token is read back from its memory
    reply = issuer.message(RegionTable())
    assert direct.parse_grant(reply).pid == os.getpid()
    forged = dict(reply, tokv=bytes(32))
    with pytest.raises(TransferError) as info:
        direct.parse_grant(forged)
    assert info.value.code == "unavailable"
    for bad in (dict(reply, r={"x": [1]}), dict(reply, pid=-1), dict(reply, tokv=b"short")):
        with pytest.raises(TransferError) as info:
            direct.parse_grant(bad)
        assert info.value.code == "protocol"


def test_iovecs_agree_between_the_small_and_the_numpy_paths():
    table = RegionTable()
    buf = np.zeros(MiB, dtype=np.uint8)
    table.register("l", buf)
    grant = direct.Grant(os.getpid(), 0, 0, {"r": (1 << 40, MiB)})
    frame = [TransferEntry("l", i * 100, "r", i * 300, 50 + i) for i in range(64)]
    small = direct._iovecs_small(grant, table, frame)
    big = direct.iovecs(grant, table, frame)
    assert all(np.array_equal(a, b) for a, b in zip(small, big))
    assert big[0][5].tolist() == [buf.ctypes.data + 500, 55] and big[1][5].tolist() == [(1 << 40) + 1500, 55]


def test_large_batches_are_checked_at_submit_as_small_ones(pair):
    _, reader, peer = pair
    ok = [("mine", i * 4096, "mem", i * 4096, 4096) for i in range(100)]
    for bad, code in ((ok + [("mine", 4 * MiB - 1, "mem", 0, 2)], "bounds"), (ok + [("nope", 0, "mem", 0, 1)],
                      "unknown_region"), (ok + [("mine", 0, "ghost", 0, 1)], "unknown_region")):
        with pytest.raises(TransferError) as info:
            reader.submit(peer, bad, "write", backend="local")
        assert info.value.code == code
    handle = reader.submit(peer, ok, "write", backend="local")  # 100 contiguous entries: one merged range
    handle.result(10)
    assert handle.total_bytes == 100 * 4096


class _Idle:
    """An engine's batch runner that never gets to a batch: its waiter runs it."""

    def submit(self, fn):
        return None

    def shutdown(self, **kwargs):
        return None


@pytest.mark.parametrize("backend", ["tcp", "local"])
def test_a_waiter_runs_an_unstarted_batch_and_still_ends_by_its_deadline(pair, backend):
    import socket
    import time

    owner, reader, peer = pair
    reader._batch_runner.shutdown(wait=True)
    reader._batch_runner = _Idle()
    handle = reader.submit(peer, [("mine", 0, "mem", 0, 4096)], "write", backend=backend)
    assert handle.wait() is BatchStatus.SUCCEEDED  # run here, in the waiting thread
    assert np.array_equal(owner.mem[:4096], reader.mine[:4096])
    mute = socket.create_server(("127.0.0.1", 0))  # accepts (in the kernel), never greets
    try:
        silent = dict(peer.to_wire(), engine_id="silent", port=mute.getsockname()[1], backends={})
        t0 = time.monotonic()
        handle = reader.submit(silent, [("mine", 0, "mem", 0, 4096)], "write", backend="tcp", deadline_s=0.5)
        assert handle.wait() is BatchStatus.FAILED and time.monotonic() - t0 < 2.0  # connect_timeout_s is 5 s
    finally:
        mute.close()


def test_a_small_batch_to_a_granted_peer_is_copied_inside_submit(pair):
    owner, reader, peer = pair
    reader._batch_runner.shutdown(wait=True)
    reader._batch_runner = _Idle()  # nothing runs but in submit or in a waiter
    reader.submit(peer, [("mine", 0, "mem", 0, 16)], "write", backend="local").wait()  # first contact: grant
    handle = reader.submit(peer, [("mine", 4096, "mem", 8192, MiB)], "write")
    assert handle.poll() is BatchStatus.SUCCEEDED  # before anyone waited
    assert np.array_equal(owner.mem[8192:8192 + MiB], reader.mine[4096:4096 + MiB])
    for kw in ({"notify": "n"}, {"backend": "tcp"}):  # a notification, or another path: not in submit
        later = reader.submit(peer, [("mine", 0, "mem", 0, 16)], "write", **kw)
        assert later.poll() is BatchStatus.PENDING and later.wait() is BatchStatus.SUCCEEDED
    big = reader.submit(peer, [("mine", 0, "mem", 0, MiB + 1)], "write")  # over inline_bytes
    assert big.poll() is BatchStatus.PENDING and big.wait() is BatchStatus.SUCCEEDED
    h = reader.submit(dict(peer.to_wire(), regions={"mem": [0, 64 * MiB]}), [("mine", 0, "mem", 8 * MiB, 16)], "write")
    assert h.poll() is BatchStatus.FAILED and h.error.code == "bounds"  # the owner's table still rules


def test_inline_copies_can_be_turned_off():
    owner = TransferEngine(TransferConfig(secret=SECRET))
    reader = TransferEngine(TransferConfig(secret=SECRET, inline_bytes=0))
    try:
        owner.register("mem", np.zeros(MiB, dtype=np.uint8))
        reader.register("mine", np.ones(MiB, dtype=np.uint8))
        peer = reader.fetch_segment(owner.segment().host, owner.segment().port)
        reader.submit(peer, [("mine", 0, "mem", 0, 16)], "write").result(10)
        reader._batch_runner.shutdown(wait=True)
        reader._batch_runner = _Idle()
        later = reader.submit(peer, [("mine", 0, "mem", 0, 16)], "write")
        assert later.poll() is BatchStatus.PENDING and later.wait() is BatchStatus.SUCCEEDED
    finally:
        owner.close()
        reader.close()
    with pytest.raises(TransferError, match="inline_bytes"):
        TransferConfig(secret=SECRET, inline_bytes=-1)


def test_one_range_copies_and_a_gone_peer_is_a_peer_error():
    from pdserve.transfer import procmem

    a, b = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    procmem.copy_one(os.getpid(), b.ctypes.data, a.ctypes.data + 8, 32, pull=True)
    assert np.array_equal(b[:32], a[8:40]) and not b[32:].any()
    assert procmem.read_word(os.getpid(), a.ctypes.data) == int.from_bytes(a[:8].tobytes(), "little")
    with pytest.raises(TransferError) as info:
        procmem.copy_one(2 ** 22 + 7, b.ctypes.data, a.ctypes.data, 8, pull=False)  # above pid_max: no such pid
    assert info.value.code == "peer"
