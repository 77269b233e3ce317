"""The worker half with tensor-parallel ranks, in one process over real transfer engines: a TP=1 D reads each
head from the P rank holding it, TP=2 D ranks read their head from a TP=1 P, every P rank frees its shard once
all its readers notified, a failed read from one rank still tells every P rank to free, and (issue 41) reads that
reshard heads are verified per head slice against what each P rank sealed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from pdserve.vllm.messages import PdserveMeta, RecvJob
from pdserve.vllm.params import BlockPlan, ConnectorConfig, RemoteParams
from pdserve.vllm.shards import rank_heads
from pdserve.vllm.worker import WorkerSide

SECRET = "0123456789abcdef-tp-worker"
BS, NB, HEADS, D = 16, 6, 2, 8


def _side(tp: int, rank: int, fill: bool) -> WorkerSide:
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS,
                                                       get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC),
                          model_config=None, parallel_config=None)
    w = WorkerSide(cfg, ConnectorConfig.from_extra({"secret": SECRET, "allow_test_faults": True}))  # type: ignore[arg-type]
    w.tp, w.rank, w.kv_heads = tp, rank, HEADS
    heads = rank_heads(HEADS, tp, rank)
    cache = torch.zeros((NB, len(heads), BS, 2 * D), dtype=torch.float32)
    if fill:
        for b in range(NB):
            for j, g in enumerate(heads):
                cache[b, j] = 1000 * g + b + 1
    w.register_kv_caches({"layer.0": cache})
    return w


def _remote(ps: list[WorkerSide], req: str, fault: str = "") -> RemoteParams:
    hs = [p.handshake() for p in ps]
    ranks = tuple((h.engine_id, h.host, h.port) for h in hs) if len(ps) > 1 else ()
    return RemoteParams(hs[0].engine_id, hs[0].host, hs[0].port, (3, 4), 2 * BS, req, hs[0].layout, "",
                        time.time() + 30, fault, ranks, HEADS, hs[0].unit)


def _released(p: WorkerSide, req: str, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if req in p.results().finished_sending:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def sides():
    made: list[WorkerSide] = []

    def make(tp: int, rank: int, fill: bool) -> WorkerSide:
        made.append(_side(tp, rank, fill))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_d_tp1_reads_each_head_from_its_p_rank(sides):
    ps = [sides(2, r, True) for r in range(2)]
    d = sides(1, 0, False)
    for p in ps:
        p._ledger.lease("req", time.time() + 30)
    d._run(RecvJob("dreq", _remote(ps, "req"), BlockPlan((0, 1), (3, 4))))
    res = d.results()
    assert res.finished_recving == {"dreq"} and not res.failed_recving
    stats = d.take_worker_meta().reads["dreq"]
    assert stats["ok"] and stats["bytes"] == 2 * HEADS * BS * 2 * D * 4 and stats["peers"] == [0, 1]
    cache = d._tensors["layer.0"]
    for lb, rb in ((0, 3), (1, 4)):
        for g in range(HEADS):
            assert torch.all(cache[lb, g] == 1000 * g + rb + 1)
    assert torch.all(cache[2:] == 0)
    assert all(_released(p, "req") for p in ps)  # D's one rank told both P ranks


def test_p_tp1_frees_only_after_both_d_ranks_read(sides):
    p = sides(1, 0, True)
    ds = [sides(2, r, False) for r in range(2)]
    p._ledger.lease("req", time.time() + 30)
    ds[0]._run(RecvJob("dreq", _remote([p], "req"), BlockPlan((0, 1), (3, 4))))
    assert not _released(p, "req", timeout=0.3)  # one reader of two
    ds[1]._run(RecvJob("dreq", _remote([p], "req"), BlockPlan((2, 5), (3, 4))))
    assert _released(p, "req")
    for r, d in enumerate(ds):
        assert d.results().finished_recving == {"dreq"}
        cache = d._tensors["layer.0"]
        local = (0, 1) if r == 0 else (2, 5)
        for lb, rb in zip(local, (3, 4)):
            assert torch.all(cache[lb, 0] == 1000 * r + rb + 1)  # D rank r holds global head r


def test_failed_read_from_one_rank_fails_the_load_and_frees_every_rank(sides):
    ps = [sides(2, r, True) for r in range(2)]
    d = sides(1, 0, False)
    for p in ps:
        p._ledger.lease("req", time.time() + 30)
    d._run(RecvJob("dreq", _remote(ps, "req", fault="fail@1"), BlockPlan((0, 1), (3, 4))))
    res = d.results()
    assert res.finished_recving == {"dreq"} and res.failed_recving == {"dreq"}
    assert d.take_invalid_blocks() == {0, 1}
    assert "fail@1" in d.take_worker_meta().reads["dreq"]["error"]
    assert all(_released(p, "req") for p in ps)


def test_zero_at_one_rank_zeroes_only_that_ranks_heads(sides):
    ps = [sides(2, r, True) for r in range(2)]
    d = sides(1, 0, False)
    d._run(RecvJob("dreq", _remote(ps, "req", fault="zero@1"), BlockPlan((0, 1), (3, 4))))
    cache = d._tensors["layer.0"]
    assert torch.all(cache[0, 0] == 4) and torch.all(cache[0, 1] == 0) and torch.all(cache[1, 1] == 0)


def test_same_tp_ranks_verify_their_shard_against_their_p_rank(sides):
    """Issue 27: with equal TP, D rank r reads whole blocks of P rank r's shard and checks them against the checksums
    P rank r sealed (its answer to r's notification); a byte flipped in rank 1's shard fails rank 1 alone."""
    ps = [sides(2, r, True) for r in range(2)]
    ds = [sides(2, r, False) for r in range(2)]
    for p in ps:
        p.start(PdserveMeta(send={"req": time.time() + 30}, seal={"req": (3, 4)}))
    for r, d in enumerate(ds):
        d._run(RecvJob("dreq", _remote(ps, "req", fault="flip@1"), BlockPlan((0, 1), (3, 4))))
        assert d.results().failed_recving == (set() if r == 0 else {"dreq"})
        stats = d.take_worker_meta().reads["dreq"]
        assert stats["ok"] == (r == 0), stats
        assert stats.get("verified") == (2 if r == 0 else 1), stats
        if r == 0:  # rank 0's shard arrived intact: P rank 0's block 3 is D rank 0's block 0
            assert torch.equal(d._tensors["layer.0"][0], ps[0]._tensors["layer.0"][3])
    assert all(_released(p, "req") for p in ps)


def _seal(ps: list[WorkerSide], req: str, fault: str = "") -> None:
    for p in ps:
        p.start(PdserveMeta(send={req: time.time() + 30}, seal={req: (3, 4)}, faults={req: fault} if fault else {}))


@pytest.mark.parametrize("fault", ["", "flip", "flip~7", "late", "late~3"])
def test_resharded_read_is_verified_per_head_slice(sides, fault):
    """Issue 41: a TP=1 D reading each head from a TP=2 P checks every head slice against what P rank r sealed
    (P's answer: its sums of the blocks D read, recomputed and compared with its seal, then per head); a byte
    flipped in transit (D) or written into P rank 1's block after its seal (P) fails the read before use."""
    ps = [sides(2, r, True) for r in range(2)]
    d = sides(1, 0, False)
    _seal(ps[:1], "req")
    _seal(ps[1:], "req", fault if fault.startswith("late") else "")
    time.sleep(0.2)  # P rank 1 sealed (and, with late, then wrote into its block)
    d._run(RecvJob("dreq", _remote(ps, "req", fault=fault if fault.startswith("flip") else ""),
                   BlockPlan((0, 1), (3, 4))))
    res = d.results()
    stats = d.take_worker_meta().reads["dreq"]
    if not fault:
        assert res.finished_recving == {"dreq"} and not res.failed_recving and stats["verified"] == 2, stats
        assert torch.all(d._tensors["layer.0"][0, 1] == 1000 + 3 + 1)
    else:
        assert res.failed_recving == {"dreq"} and stats["checksum_failed"], stats
        assert "differ from P's checksums" in stats["error"], stats
        assert ("changed after P sealed them" in stats["error"]) == fault.startswith("late"), stats
        assert d.take_invalid_blocks() == {0, 1}
    assert all(_released(p, "req") for p in ps)


def test_d_tp2_ranks_verify_their_heads_of_a_tp1_p(sides):
    """1 -> 2: each D rank names its head to the one P rank; a flip on D rank 1 fails rank 1 alone."""
    p = sides(1, 0, True)
    ds = [sides(2, r, False) for r in range(2)]
    _seal([p], "req")
    for r, d in enumerate(ds):
        d._run(RecvJob("dreq", _remote([p], "req", fault="flip~11@1"), BlockPlan((0, 1), (3, 4))))
        assert d.results().failed_recving == (set() if r == 0 else {"dreq"})
        stats = d.take_worker_meta().reads["dreq"]
        assert stats["ok"] == (r == 0) and (stats["verified"] == 2) == (r == 0), stats
    assert _released(p, "req")


def test_p_answers_head_sums_only_for_bytes_it_sealed(sides):
    """P's side of a head-slice answer: head sums that add nothing D cannot recompute, refused once the block
    changed after its seal."""
    from pdserve.vllm.head_sums import head_reply, head_sums

    p = sides(2, 0, True)
    _seal([p], "req")
    reply = p._seals.reply("req", p.sums.alg, p.fp_digest)
    answer = head_reply(reply, p.sums, p.rank_layers, [3, 4], [0])
    assert answer["h"] == [0] and answer["b"] == [3, 4]
    assert answer["c"] == head_sums(p.rank_layers, p._memory, [0], [3, 4], p.sums.alg)
    assert answer["c"][0] == p.sums.sums([3, 4])  # one head per rank: its slice is the whole block
    p.sums.flip_byte(4, at=9)
    assert head_reply(reply, p.sums, p.rank_layers, [3, 4], [0]) == {"fp": p.fp_digest, "changed": [4]}
    assert head_reply({"fp": 1, "missing": "x"}, p.sums, p.rank_layers, [3], [0]) == {"fp": 1, "missing": "x"}
