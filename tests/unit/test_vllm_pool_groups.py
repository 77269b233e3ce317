"""The KV pool for hybrid KV caches (pdserve.vllm.pool_groups and the scheduler's pool path with KV cache groups):
which blocks of each group a finished request saves, how long a pooled prefix a later request loads (every group
pooled as a continuation needs it: a sliding window's blocks before the prefix's end, a Mamba state at exactly the
prefix's length), and the load's plan. No vLLM: specs, blocks and the pool master are small fakes."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.hashing import block_hashes
from pdserve.vllm.groups import FULL, MAMBA, SLIDING, GroupSpec
from pdserve.vllm.messages import PoolJob
from pdserve.vllm.params import ConnectorConfig
from pdserve.vllm.pool import loaded_tokens
from pdserve.vllm.pool_groups import group_key, keys_of, load_groups, longest, needed, pool_refusal, save_items
from pdserve.vllm.scheduler import SchedulerSide

from .test_vllm_groups import blocks
from .test_vllm_scheduler import HS, SECRET, Req, Status, clock, prompt  # noqa: F401  (clock: a fixture)

SW = GroupSpec(SLIDING, 4, window=6)
FA = GroupSpec(FULL, 4)
SSM = GroupSpec(MAMBA, 4)
GROUPS = (SW, FA, SSM)


class Pool:
    """The pool master: which object keys it holds; what was asked."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.asked: list[list[int]] = []

    def prefix(self, keys: list[int]) -> int:
        raise AssertionError("a hybrid lookup asks exists(), not a chained prefix")

    def exists(self, keys: list[int]) -> list[bool]:
        self.asked.append(list(keys))
        return [k in self.held for k in keys]


class Blocks:
    """vLLM's KVCacheBlocks of several groups."""

    def __init__(self, *groups: list[int]) -> None:
        self.blocks = tuple(blocks(*ids) for ids in groups)


def test_only_the_first_full_group_keeps_the_plain_key_and_sizes_must_agree():
    keys = [11, 12]
    per = keys_of(GROUPS, keys)
    assert per[1] == keys and per[0] == [group_key(k, 0, SW) for k in keys] and per[2][0] != per[0][0]
    assert len({k for g in per for k in g}) == 6
    assert pool_refusal(GROUPS) == "" and "block sizes [4, 8]" in pool_refusal((FA, GroupSpec(MAMBA, 8)))


def test_a_finished_request_saves_held_window_blocks_and_the_state_at_its_exact_length():
    keys = [1, 2, 3]  # 12 computed tokens: three full blocks
    ids = ([0, 11, 12], [21, 22, 23], [0, 0, 31])
    got_keys, got_ids = save_items(GROUPS, ids, keys, 12)
    per = keys_of(GROUPS, keys)
    assert got_ids == (11, 12, 21, 22, 23, 31)
    assert got_keys == (per[0][1], per[0][2], 1, 2, 3, per[2][2])
    # 13 computed tokens: the state block (position 3) is after 13 tokens, no key names that length: not saved
    assert save_items(GROUPS, ([0, 11, 12, 13], [21, 22, 23, 24], [0, 0, 0, 31]), keys, 13)[1] == (11, 12, 21, 22, 23)


@pytest.mark.parametrize("first, end, want", [(0, 3, ([1, 2], [0, 1, 2], [2])), (2, 3, ([2], [2], [2])),
                                              (0, 1, ([0], [0], [0])), (3, 3, ([], [], []))])
def test_a_load_needs_each_group_s_continuation_blocks(first, end, want):
    # window 6 at 12 tokens: the next token sees tokens 7..12, blocks from 1
    assert tuple(list(needed(g, first, end)) for g in GROUPS) == want


def test_longest_pooled_prefix_needs_every_group():
    keys = [1, 2, 3, 4]
    per = keys_of(GROUPS, keys)
    pooled = {1, 2, 3, per[0][1], per[0][2], per[2][2]}  # what a 12-token request saved
    assert longest(GROUPS, keys, 0, pooled) == 3
    assert longest(GROUPS, keys, 0, pooled - {per[2][2]}) == 0  # no state at a pooled length
    assert longest(GROUPS, keys, 0, pooled - {per[0][1]}) == 0  # the window before 12 tokens is gone
    assert longest(GROUPS, keys, 0, pooled | {4, per[0][3]}) == 3  # block 4's state is missing
    assert longest(GROUPS, keys, 0, pooled | {4, per[0][3], per[2][3]}) == 4
    assert longest(GROUPS, keys, 1, {2, 3, per[0][1], per[0][2], per[2][2]}) == 3  # D holds block 0 itself
    assert load_groups(GROUPS, keys, 0, 3) == ((1, (per[0][1], per[0][2])), (0, (1, 2, 3)), (2, (per[2][2],)))


def hybrid_side(pool: Pool) -> SchedulerSide:
    config = ConnectorConfig.from_extra({"secret": SECRET, "pool_master": "127.0.0.1:7600"})
    s = SchedulerSide(config, 4, pool, groups=GROUPS)
    s.set_handshake({0: HS})
    return s


def saved(s: SchedulerSide, n: int, ids: tuple[list[int], ...], out: int = 0) -> Any:
    req = Req("a", prompt(n), None, Status.FINISHED_LENGTH_CAPPED, n, output_token_ids=[7] * out)
    delay, _ = s.request_finished_groups(req, ids)
    jobs = s.build_connector_meta(None).pool
    return delay, jobs


def test_scheduler_saves_every_group_then_a_sharing_prompt_loads_them_into_its_blocks(clock):
    pool = Pool()
    s = hybrid_side(pool)
    delay, jobs = saved(s, 12, ([0, 11, 12], [21, 22, 23], [0, 0, 31]))
    assert delay and len(jobs) == 1 and jobs[0].save and jobs[0].block_ids == (11, 12, 21, 22, 23, 31)
    pool.held.update(jobs[0].keys)
    # a 20-token prompt sharing the 12: L <= (20 - 1) // 4 blocks, the longest with every group pooled is 3
    req = Req("b", prompt(12) + prompt(8, base=900), None)
    assert s.get_num_new_matched_tokens(req, 0) == (12, True)
    s.update_state_after_alloc(req, Blocks([0, 51, 52], [61, 62, 63], [0, 0, 71]), 12)
    (job,) = s.build_connector_meta(None).pool
    assert not job.save and job.tokens == 12 and not job.error
    assert job.block_ids == (51, 52, 61, 62, 63, 71)
    per = keys_of(GROUPS, block_hashes(req.prompt_token_ids, 4))
    assert job.keys == (per[0][1], per[0][2], per[1][0], per[1][1], per[1][2], per[2][2])


def test_no_load_without_the_state_at_that_length_or_beyond_the_prompt_s_last_token(clock):
    pool = Pool()
    s = hybrid_side(pool)
    _, jobs = saved(s, 13, ([0, 11, 12, 13], [21, 22, 23, 24], [0, 0, 0, 31]))  # state after 13: not pooled
    pool.held.update(jobs[0].keys)
    assert s.get_num_new_matched_tokens(Req("b", prompt(12) + prompt(8, base=900), None), 0) == (0, False)
    pool2 = Pool()
    s2 = hybrid_side(pool2)
    _, jobs = saved(s2, 12, ([0, 11, 12], [21, 22, 23], [0, 0, 31]))
    pool2.held.update(jobs[0].keys)
    # the very prompt again: 12 tokens, at most 11 may load, so no pooled length fits (vLLM computes one token)
    assert s2.get_num_new_matched_tokens(Req("c", prompt(12), None), 0) == (0, False)


def test_a_load_d_cannot_pair_is_planned_as_failed(clock):
    pool = Pool()
    s = hybrid_side(pool)
    _, jobs = saved(s, 12, ([0, 11, 12], [21, 22, 23], [0, 0, 31]))
    pool.held.update(jobs[0].keys)
    req = Req("b", prompt(12) + prompt(8, base=900), None)
    assert s.get_num_new_matched_tokens(req, 0) == (12, True)
    s.update_state_after_alloc(req, Blocks([50, 51, 52], [61, 62, 63], [0, 0, 71]), 12)  # D kept window block 0
    (job,) = s.build_connector_meta(None).pool
    assert job.error == "plan" and job.tokens == 12 and set(job.block_ids) == {50, 51, 52, 61, 62, 63, 71}


def test_a_short_window_leaves_nothing_to_load(clock):
    pool = Pool()
    s = hybrid_side(pool)
    # 20 computed tokens: the window keeps blocks from 3 on, so the 12-token prefix's window is gone
    _, jobs = saved(s, 20, ([0, 0, 0, 13, 14], [21, 22, 23, 24, 25], [0, 0, 0, 0, 31]))
    pool.held.update(jobs[0].keys)
    assert s.get_num_new_matched_tokens(Req("b", prompt(12) + prompt(8, base=900), None), 0) == (0, False)


def test_a_hybrid_load_is_all_or_none():
    hybrid = PoolJob("b", (1, 2, 3), (51, 61, 71), False, tokens=12)
    assert loaded_tokens(hybrid, 3, 4) == (3, 12) and loaded_tokens(hybrid, 2, 4) == (0, 0)
    plain = PoolJob("b", (1, 2, 3), (51, 52, 53), False)
    assert loaded_tokens(plain, 2, 4) == (2, 8)
