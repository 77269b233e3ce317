"""Hybrid KV caches (vLLM's hybrid KV cache manager): which blocks of each KV cache group P hands off and D reads
(pdserve.vllm.groups), the shared-tensor regions (pdserve.vllm.regions), the wire field and the scheduler's
hybrid path (P's lease, D's plan, partial loads refused). No vLLM: specs and blocks are small fakes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.vllm.groups import FULL, MAMBA, SLIDING, GroupSpec, flat, groups_of, hand_off, hybrid_tag, pair, spec_of
from pdserve.vllm.messages import PdserveHandshake
from pdserve.vllm.params import BlockPlan, ConnectorConfig, LayerGeometry, RemoteParams, parse_groups, prompt_hash
from pdserve.vllm.regions import join
from pdserve.vllm.scheduler import SchedulerSide

from .test_vllm_scheduler import HS, NOW, SECRET, Req, Status, clock, prompt  # noqa: F401  (clock: a fixture)

SW = GroupSpec(SLIDING, 4, window=6)
FA = GroupSpec(FULL, 4)
SSM = GroupSpec(MAMBA, 8)
GROUPS = (SW, FA, SSM)


class SlidingWindowSpec:  # the class names spec_of reads
    def __init__(self, block_size: int, sliding_window: int) -> None:
        self.block_size, self.sliding_window = block_size, sliding_window


class FullAttentionSpec:
    block_size, sliding_window = 16, None


class FullAttentionSpecOfAWindow(FullAttentionSpec):  # vLLM with the manager off: keeps every block
    sliding_window = 128


class MambaSpec:
    block_size = 640


class CrossAttentionSpecLike:
    block_size = 16


def blocks(*ids: int) -> list[Any]:
    return [SimpleNamespace(block_id=i, block_hash=None, is_null=i == 0) for i in ids]


def test_group_specs_from_vllm_specs():
    cfg = SimpleNamespace(transfer_groups=[SimpleNamespace(kv_cache_spec=SlidingWindowSpec(16, 128)),
                                           SimpleNamespace(kv_cache_spec=FullAttentionSpec()),
                                           SimpleNamespace(kv_cache_spec=MambaSpec())])
    assert groups_of(cfg, 16) == (GroupSpec(SLIDING, 16, 128), GroupSpec(FULL, 16), GroupSpec(MAMBA, 640))
    assert hybrid_tag(groups_of(cfg, 16)) == "+hma:s16w128.f16.m640"
    assert hybrid_tag((GroupSpec(FULL, 16),)) == ""
    assert spec_of(FullAttentionSpecOfAWindow(), 16) == GroupSpec(FULL, 16)
    with pytest.raises(ValueError, match="moves full attention, sliding-window and Mamba"):
        spec_of(SimpleNamespace(block_size=16), 16)


@pytest.mark.parametrize("n, first", [(5, 0), (6, 0), (7, 0), (9, 1), (10, 1), (13, 2)])
def test_sliding_window_needs_only_the_blocks_the_next_window_reaches(n, first):
    # window 6: the token at position n sees tokens [n-5, n], so blocks from (n-5)//4
    assert SW.first_needed(n) == first
    assert FA.first_needed(n) == 0
    assert SSM.first_needed(n) == -(-n // 8) - 1  # the state block at the prompt's end


def test_p_hands_off_each_group_s_needed_blocks_and_refuses_freed_ones():
    ids = ([0, 11, 12, 13], [21, 22, 23, 24], [0, 31])  # 13 tokens: SW freed block 0, Mamba keeps its last
    handed = hand_off(GROUPS, ids, 13)
    assert handed == ((2, (12, 13)), (0, (21, 22, 23, 24)), (1, (31,)))
    assert flat(handed) == (12, 13, 21, 22, 23, 24, 31)
    with pytest.raises(ValueError, match="not all held"):
        hand_off(GROUPS, ([0, 0, 0, 13], ids[1], ids[2]), 13)
    with pytest.raises(ValueError, match="2 block lists for 3"):
        hand_off(GROUPS, ids[:2], 13)


def test_d_pairs_positions_past_its_prefix_hit_and_skips_null_blocks():
    handed = ((2, (12, 13)), (0, (21, 22, 23, 24)), (1, (31,)))
    local = (blocks(0, 0, 52, 53), blocks(61, 62, 63, 64), blocks(0, 71))
    assert pair(GROUPS, local, handed, 13) == BlockPlan((52, 53, 61, 62, 63, 64, 71), (12, 13, 21, 22, 23, 24, 31))
    # D's own prefix cache holds 8 tokens: blocks 0-1 of the 4-token groups, none of the 8-token Mamba blocks' end
    assert pair(GROUPS, local, handed, 13, hit=8) == BlockPlan((52, 53, 63, 64, 71), (12, 13, 23, 24, 31))
    with pytest.raises(ValueError, match="P handed off positions"):  # D needs a block P did not send
        pair(GROUPS, (blocks(0, 51, 52, 53), local[1], local[2]), handed, 13)


def test_remote_group_blocks_travel_and_are_validated():
    r = RemoteParams("e", "h", 1, (12, 13, 21), 9, "p1", groups=((2, (12, 13)), (0, (21,))))
    back = RemoteParams.parse(r.to_params(), 4)
    assert back.groups == r.groups and back.block_ids == (12, 13, 21)
    for bad in ([[0, [1, 0]]], [[-1, [1]]], [[0, 1]], "x", [[True, [1]]]):
        with pytest.raises(ValueError, match="remote_group_blocks"):
            parse_groups(bad)


def test_layers_sharing_a_tensor_become_one_region_covering_their_runs():
    attn = LayerGeometry("a", 1000, 1000, ((0, 1000),), "[attn]")
    ssm = LayerGeometry("m", 1000, 700, ((0, 700),), "[state]")
    region = join(ssm, LayerGeometry("m", 1000, 1000, ((0, 1000),), "[attn]"))
    assert region.block_runs == ((0, 1000),) and region.block_bytes == 1000 and region.name == "m"
    assert join(attn, LayerGeometry("a", 1000, 1000, ((0, 1000),), "[attn]")) is attn
    split = join(LayerGeometry("k", 100, 20, ((0, 10), (50, 10))), LayerGeometry("k", 100, 20, ((5, 10), (80, 10))))
    assert split.block_runs == ((0, 15), (50, 10), (80, 10))
    with pytest.raises(ValueError, match="block strides"):
        join(attn, LayerGeometry("a", 2000, 1000, ((0, 1000),)))


# ---- the scheduler's hybrid path ----
def hybrid_side() -> SchedulerSide:
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET}), 4, None, groups=GROUPS)
    s.set_handshake({0: HS})
    return s


def test_p_leases_every_group_s_handed_off_blocks(clock):
    s = hybrid_side()
    req = Req("p1", prompt(13), {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, 13)
    delay, out = s.request_finished_groups(req, ([0, 11, 12, 13], [21, 22, 23, 24], [0, 31]))
    assert delay and out is not None
    assert out["remote_group_blocks"] == [[2, [12, 13]], [0, [21, 22, 23, 24]], [1, [31]]]
    assert out["remote_block_ids"] == [12, 13, 21, 22, 23, 24, 31]
    meta = s.build_connector_meta(None)
    assert meta.seal == {"p1": (12, 13, 21, 22, 23, 24, 31)}  # P seals exactly what D may read


def test_p_frees_a_request_whose_window_is_gone(clock):
    s = hybrid_side()
    req = Req("p1", prompt(13), {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, 13)
    assert s.request_finished_groups(req, ([0, 0, 0, 13], [21, 22, 23, 24], [0, 31])) == (False, None)


def d_params(n: int = 13) -> dict[str, Any]:
    r = RemoteParams(HS.engine_id, HS.host, HS.port, (12, 13, 21, 22, 23, 24, 31), n, "p1", HS.layout,
                     prompt_hash(prompt(n), n), NOW + 30, groups=((2, (12, 13)), (0, (21, 22, 23, 24)), (1, (31,))))
    return r.to_params()


def test_d_reads_every_group_s_blocks(clock):
    s = hybrid_side()
    req = Req("d1", prompt(14), d_params())  # the prompt plus P's first token
    count, _ = s.get_num_new_matched_tokens(req, 0)
    assert count == 13
    s.update_state_after_alloc(req, SimpleNamespace(blocks=(blocks(0, 0, 52, 53), blocks(61, 62, 63, 64),
                                                            blocks(0, 71))), 13)
    (job,) = s.build_connector_meta(None).recv
    assert job.plan == BlockPlan((52, 53, 61, 62, 63, 64, 71), (12, 13, 21, 22, 23, 24, 31)) and not job.error


def test_d_loads_a_mamba_state_asynchronously(clock):
    # a synchronous read lands after vLLM copied the state into the step's new block (a prompt ending on a block)
    s = hybrid_side()
    s.handshake = PdserveHandshake(HS.engine_id, HS.host, HS.port, HS.layout, block_bytes=1)
    assert s.get_num_new_matched_tokens(Req("d1", prompt(14), d_params()), 0) == (13, True)
    s.groups = (SW, FA)
    assert s.get_num_new_matched_tokens(Req("d2", prompt(14), d_params()), 0) == (13, False)


def test_d_given_the_prompt_alone_computes_a_mamba_model_s_prompt(clock):
    s = hybrid_side()
    req = Req("d1", prompt(13), d_params())  # no first token: D would need the state after 12 tokens
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)


def test_d_without_p_s_group_blocks_fails_the_read_so_vllm_recomputes(clock):
    s = hybrid_side()
    params = {**d_params(), "remote_group_blocks": None}
    req = Req("d1", prompt(14), params)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, SimpleNamespace(blocks=(blocks(0, 0, 52, 53), blocks(61, 62, 63, 64),
                                                            blocks(0, 71))), 13)
    (job,) = s.build_connector_meta(None).recv
    assert "one block list" in job.error


def test_d_refuses_a_hybrid_cache_from_another_tensor_parallel_degree(clock):
    s = hybrid_side()
    params = {**d_params(), "remote_ranks": [["e0", "h", 1], ["e1", "h", 2]], "remote_kv_heads": 2}
    assert s.get_num_new_matched_tokens(Req("d1", prompt(14), params), 0) == (0, False)
    assert "moves only between equal tensor-parallel degrees" in s._reads["d1"]["refused"]
