"""Tensor-parallel KV planning: which heads each rank holds, who reads and notifies whom, and the exact
transfer entries of head slices (checked byte for byte by applying them to real tensors in vLLM's layouts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.vllm.flips import fault_seed, placements
from pdserve.vllm.layout import LayoutError, head_runs, layout_from_order, reshard
from pdserve.vllm.messages import NOTIFIED, PdserveWorkerMeta, merge_reads
from pdserve.vllm.params import BlockPlan, RemoteParams, fault_hits, known_test_fault
from pdserve.vllm.release import ReleaseLedger
from pdserve.vllm.shards import (
    HeadSlice,
    RankLayer,
    ShardError,
    notifiers,
    notify_message,
    parse_notify,
    peer_ranks,
    plan_slices,
    rank_heads,
    release_notifiers,
    slice_entries,
    split_heads,
    to_notify,
    unit_signature,
)

# vLLM 0.32 KVCacheLayout per-layer view orders of the logical [B, H, N, C]
ORDERS = {"LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3), "LHBNC": (1, 0, 2, 3)}


def test_rank_heads_follow_vllm_sharding():
    assert [rank_heads(8, 2, r) for r in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0,), (0,), (1,), (1,)]  # replicated
    assert rank_heads(2, 1, 0) == (0, 1)
    with pytest.raises(ShardError, match="3 KV heads cannot be split over tp=2"):
        rank_heads(3, 2, 0)


def test_plan_slices_pairs_heads_with_their_p_rank():
    # P tp=2 (one head each) -> D tp=1: D's head j comes from P rank j, its head 0
    assert plan_slices(2, 2, 1, 0) == (HeadSlice(0, 0, 0), HeadSlice(1, 1, 0))
    # P tp=1 -> D tp=2: D rank 1 holds global head 1 = P rank 0's head 1
    assert plan_slices(2, 1, 2, 1) == (HeadSlice(0, 0, 1),)
    # P tp=4 over 8 heads (2 each) -> D tp=2 (4 each): D rank 1 reads P ranks 2 and 3
    assert plan_slices(8, 4, 2, 1) == (HeadSlice(0, 2, 0), HeadSlice(1, 2, 1), HeadSlice(2, 3, 0),
                                       HeadSlice(3, 3, 1))
    # P tp=4 replicates 2 heads -> D tp=1 reads the first replica of each
    assert plan_slices(2, 4, 1, 0) == (HeadSlice(0, 0, 0), HeadSlice(1, 2, 0))


def test_plan_slices_refuses_naming_both_layouts():
    with pytest.raises(ShardError, match=r"P tp=2 x 4 KV heads vs D tp=3 x 4 KV heads"):
        plan_slices(4, 2, 3, 0)
    with pytest.raises(ShardError, match="different models"):
        plan_slices(4, 2, 1, 0, p_total=8)


def test_notifiers_cover_every_p_rank_once_per_reader():
    assert notifiers(2, 2, 2) == {0: (0,), 1: (1,)}  # same TP: rank r <-> rank r
    assert notifiers(2, 2, 1) == {0: (0,), 1: (0,)}  # D's one rank notifies both
    assert notifiers(2, 1, 2) == {0: (0, 1)}  # P's one rank waits for both D ranks
    assert notifiers(2, 4, 1) == {0: (0,), 1: (0,), 2: (0,), 3: (0,)}  # replicas nobody reads: told anyway
    assert notifiers(8, 4, 2) == {0: (0,), 1: (0,), 2: (1,), 3: (1,)}
    assert peer_ranks(8, 4, 2, 1) == (2, 3) and peer_ranks(0, 3, 3, 2) == (2,)
    assert to_notify(notifiers(2, 1, 2), 1) == {0: 2}
    assert release_notifiers(2, 1) == {0: (0,), 1: (0,)} and release_notifiers(1, 2) == {0: (0,)}


def test_notify_message_names_the_heads_of_a_resharded_read():
    msg = notify_message("req|x", 1, 2, (7, 9), heads=(0, 3))
    assert split_heads(msg) == (notify_message("req|x", 1, 2, (7, 9)), (0, 3))
    assert parse_notify(split_heads(msg)[0]) == ("req|x", 1, 2, (7, 9))
    assert split_heads("req#heads=x") == ("req#heads=x", ()) and split_heads("req-1") == ("req-1", ())


def test_notify_message_round_trip_and_bare_ids():
    assert notify_message("req-1", 0, 1) == "req-1"  # one reader: what a TP=1 D always sent
    assert parse_notify(notify_message("req|x", 1, 2)) == ("req|x", 1, 2, ())
    assert parse_notify("req-1") == ("req-1", 0, 1, ())
    assert parse_notify("a|b") == ("a|b", 0, 1, ())
    assert parse_notify(notify_message("req|x", 1, 2, (7, 9))) == ("req|x", 1, 2, (7, 9))  # the blocks D read
    assert parse_notify(notify_message("req-1", 0, 1, (3,))) == ("req-1", 0, 1, (3,))


def test_ledger_waits_for_every_reader_of_a_rank():
    ledger = ReleaseLedger()
    ledger.lease("r", 100.0)
    ledger.notify("r", now=1.0, sender=0, readers=2)
    ledger.notify("r", now=1.5, sender=0, readers=2)  # a duplicate from the same D rank
    assert ledger.step(now=2.0).finished_sending == set()
    ledger.notify("r", now=3.0, sender=1, readers=2)
    out = ledger.step(now=4.0)
    assert out.finished_sending == {"r"} and out.lease_ends == {"r": NOTIFIED}


def test_ledger_lease_still_ends_a_half_notified_hold():
    ledger = ReleaseLedger()
    ledger.lease("r", 10.0)
    ledger.notify("r", now=1.0, sender=1, readers=2)
    assert ledger.step(now=5.0).finished_sending == set()
    assert ledger.step(now=10.0).lease_ends == {"r": "lease"}


def test_read_stats_merge_over_ranks():
    a = {"bytes": 100, "ms": 2.0, "ok": True, "blocks": 3, "ranks": 1, "per_rank": {0: [100, 2.0]}}
    b = {"bytes": 50, "ms": 5.0, "ok": False, "blocks": 3, "ranks": 1, "per_rank": {1: [50, 5.0]},
         "error": "boom"}
    m = merge_reads(a, b)
    assert m == {"bytes": 150, "ms": 5.0, "ok": False, "blocks": 3, "ranks": 2,
                 "per_rank": {0: [100, 2.0], 1: [50, 5.0]}, "error": "boom"}
    agg = PdserveWorkerMeta(reads={"x": a}).aggregate(PdserveWorkerMeta(reads={"x": b}))
    assert agg.reads["x"]["ranks"] == 2


def test_remote_params_carry_ranks():
    r = RemoteParams("e0", "h", 5000, (1, 2), 200, "req", "lay", "", 0.0, "",
                     (("e0", "h", 5000), ("e1", "h", 5001)), 8, "unit")
    p = r.to_params()
    assert p["remote_ranks"] == [["e0", "h", 5000], ["e1", "h", 5001]] and p["remote_kv_heads"] == 8
    back = RemoteParams.parse(p, 128)
    assert back.tp == 2 and back.rank(1) == ("e1", "h", 5001) and back.unit == "unit"
    one = RemoteParams.parse(RemoteParams("e0", "h", 5000, (1, 2), 200, "req").to_params(), 128)
    assert one.tp == 1 and one.rank(0) == ("e0", "h", 5000) and "remote_ranks" not in one.to_params()
    for bad in ([["e", "h", 0]], [["e", "h"]], "x", [], [["e", "h", True]]):
        with pytest.raises(ValueError, match="remote_ranks"):
            RemoteParams.parse(dict(p, remote_ranks=bad), 128)


def test_test_faults_per_rank():
    assert fault_hits("zero", "zero", 3) and fault_hits("zero@1", "zero", 1)
    assert not fault_hits("zero@1", "zero", 0) and not fault_hits("fail@1", "zero", 1)
    assert known_test_fault("fail@2") and not known_test_fault("fail@x") and not known_test_fault("boom")
    assert fault_hits("flip~17", "flip", 0) and fault_hits("flip~17@1", "flip", 1)
    assert not fault_hits("flip~17@1", "flip", 0) and not fault_hits("flip@", "flip", 0)
    assert known_test_fault("flip~17@1") and known_test_fault("late~3")
    assert not known_test_fault("zero~3") and not known_test_fault("flip~x")


def test_random_flip_placements_are_seeded_and_spread():
    """flip~SEED: one to four units anywhere in the read, a byte inside each, a non-zero mask; the same seed
    gives the same places; over many seeds every block and every unit (every layer's runs) is hit."""
    sizes = [256, 256, 64, 64]  # e.g. two layers of K and V runs
    assert placements("flip", sizes, 3) == [(0, 0, 0, 0xFF)] and placements("flip~1", sizes, 0) == []
    seen: set[tuple[int, int]] = set()
    for seed in range(200):
        flips = placements(f"flip~{seed}", sizes, 3)
        assert flips == placements(f"flip~{seed}@2", sizes, 3) and 1 <= len(flips) <= 4
        assert len({(s, k) for s, k, _, _ in flips}) == len(flips)
        for slot, k, at, mask in flips:
            assert 0 <= slot < 3 and 0 <= at < sizes[k] and 1 <= mask <= 255
            seen.add((slot, k))
    assert seen == {(s, k) for s in range(3) for k in range(4)}
    assert fault_seed("late~9") == 9 and fault_seed("zero~9") is None and fault_seed("flip") is None


# ---- layouts: resharding and head slices on real tensors ----

def _cache(order: str, blocks: int, heads: int, tokens: int = 4, content: int = 6) -> torch.Tensor:
    """vLLM's per-layer logical [B, H, N, C] view over a dense buffer in ``order``'s physical order."""
    view = ORDERS[order]
    logical = (blocks, heads, tokens, content)
    buf = torch.zeros(tuple(logical[d] for d in view), dtype=torch.float32)
    inverse = sorted(range(4), key=lambda i: view[i])
    return buf.permute(*inverse)


def _layout(t: torch.Tensor, order: str):
    return layout_from_order(t.shape, t.stride(), t.element_size(), "TEST", order, ORDERS[order])


@pytest.mark.parametrize("order", list(ORDERS))
def test_reshard_matches_the_real_layout(order):
    kv = _layout(_cache(order, 5, 2), order)
    for heads, blocks in ((1, 7), (4, 3), (2, 5)):
        real = _layout(_cache(order, blocks, heads), order)
        assert reshard(kv, heads, blocks) == real


def test_head_runs_exact_entries():
    # LBHNC [B=5, H=2, N=4, C=6] fp32: a block is 192 B, head 1 is its second half
    kv = _layout(_cache("LBHNC", 5, 2), "LBHNC")
    assert head_runs(kv, 1) == ((96, 96),)
    assert head_runs(kv, 1, ratio=2) == ((96, 96), (288, 96))
    # LBNHC (NHD): head 1 is one 24 B run per token
    nhd = _layout(_cache("LBNHC", 5, 2), "LBNHC")
    assert head_runs(nhd, 1) == ((24, 24), (72, 24), (120, 24), (168, 24))
    # LHBNC: heads outside the blocks: head 1 starts after all 5 blocks of head 0
    hb = _layout(_cache("LHBNC", 5, 2), "LHBNC")
    assert head_runs(hb, 1) == ((480, 96),)
    with pytest.raises(LayoutError, match="out of range"):
        head_runs(kv, 2)


def test_slice_entries_exact_p2_to_d1():
    d = RankLayer("l0", _layout(_cache("LBHNC", 4, 2), "LBHNC"))  # D: 2 heads, 4 blocks, 192 B/block
    plan = BlockPlan(local=(2, 3), remote=(0, 6))  # P ranks: 1 head, 96 B/block
    out = slice_entries([d], plan, plan_slices(2, 2, 1, 0), peer_heads=1, peer_blocks=7)
    assert out == {0: [("l0", 384, "l0", 0, 96), ("l0", 576, "l0", 576, 96)],
                   1: [("l0", 480, "l0", 0, 96), ("l0", 672, "l0", 576, 96)]}


def _fill_global(order: str, tp: int, rank: int, total: int, blocks: int, seed_blocks: dict[int, int]) -> torch.Tensor:
    """A rank's cache whose block ``b`` of global head g holds values naming (seed block, g, token, c)."""
    heads = rank_heads(total, tp, rank)
    t = _cache(order, blocks, len(heads))
    for b, sb in seed_blocks.items():
        for j, g in enumerate(heads):
            n, c = t.shape[2], t.shape[3]
            t[b, j] = torch.arange(n * c, dtype=torch.float32).view(n, c) + 1000 * g + 100000 * (sb + 1)
    return t


def _region(t: torch.Tensor) -> np.ndarray:
    base = t.permute(*sorted(range(4), key=lambda i: t.stride()[i], reverse=True)).contiguous()
    assert base.data_ptr() == t.data_ptr()  # already dense: no copy
    return base.numpy().view(np.uint8).reshape(-1)


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("total, p_tp, d_tp", [(2, 2, 1), (2, 1, 2), (8, 4, 2), (4, 2, 4), (2, 4, 1)])
def test_slice_entries_move_the_right_heads(order, total, p_tp, d_tp):
    """Apply the planned entries byte for byte: every D rank ends with exactly its heads of P's blocks."""
    p_blocks, d_blocks = 9, 6
    remote, local = (7, 1, 4), (0, 5, 2)
    seeds = {rb: i for i, rb in enumerate(remote)}
    p_caches = [_fill_global(order, p_tp, r, total, p_blocks, seeds) for r in range(p_tp)]
    p_heads = len(rank_heads(total, p_tp, 0))
    for d_rank in range(d_tp):
        d_cache = _cache(order, d_blocks, len(rank_heads(total, d_tp, d_rank)))
        layer = RankLayer("l", _layout(d_cache, order))
        plan = BlockPlan(local, remote)
        batches = slice_entries([layer], plan, plan_slices(total, p_tp, d_tp, d_rank), p_heads, p_blocks)
        assert set(batches) == set(peer_ranks(total, p_tp, d_tp, d_rank))
        dst = _region(d_cache)
        for p, entries in batches.items():
            src = _region(p_caches[p])
            for _, loff, _, poff, n in entries:
                dst[loff:loff + n] = src[poff:poff + n]
        want = _fill_global(order, d_tp, d_rank, total, d_blocks, {lb: i for i, lb in enumerate(local)})
        assert torch.equal(d_cache, want)


def test_unit_signature_ignores_tp_and_block_count_only():
    def sig(order: str, heads: int, blocks: int, content: int = 6) -> str:
        return unit_signature("float32", 16, [RankLayer("l", _layout(_cache(order, blocks, heads, 4, content), order))])

    assert sig("LBHNC", 2, 5) == sig("LBHNC", 1, 9) != ""
    assert sig("LBHNC", 2, 5) != sig("LBNHC", 2, 5)  # HND vs NHD
    assert sig("LBHNC", 2, 5) != sig("LBHNC", 2, 5, content=8)  # head size
