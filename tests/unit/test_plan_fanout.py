"""pdserve plan: the P -> D transfer fan-out when prefill and decode workers run different TP degrees."""

from __future__ import annotations

import pytest

from pdserve.plan.cli import main
from pdserve.plan.cost import Fanout
from pdserve.plan.hardware import Link

LINK = Link("test", bytes_s=100e9, gpus=8, efficiency=0.5, overhead_s=0.001)  # 6.25 GB/s per device share


def test_fanout_of_p4_to_d2_over_8_heads():
    f = Fanout(4, 2, 8)
    assert (f.p_ranks_per_d_rank, f.d_ranks_per_p_rank, f.flows, f.strided) == (2, 1, 4, True)
    assert f.moved_bytes(8e9) == 8e9 and f.busiest_rank_bytes(8e9) == 4e9  # each D rank receives half
    assert f.transfer_s(8e9, LINK) == pytest.approx(4e9 / 6.25e9 + 2 * 0.001)


def test_fanout_with_replicated_heads():
    f = Fanout(1, 4, 2)  # D replicates each of 2 heads on 2 ranks: every D rank reads its head
    assert (f.p_ranks_per_d_rank, f.d_ranks_per_p_rank, f.flows) == (1, 2, 4)
    assert f.moved_bytes(2e9) == 4e9 and f.busiest_rank_bytes(2e9) == 4e9  # P's one rank sends it all
    same = Fanout(2, 2, 8)
    assert not same.strided and same.transfer_s(8e9, LINK) == pytest.approx(4e9 / 6.25e9 + 0.001)


def test_fanout_refuses_heads_that_do_not_split():
    with pytest.raises(ValueError, match="D tp=3 cannot shard 8 KV heads"):
        Fanout(2, 3, 8)


def test_plan_reports_the_fanout(capsys):
    assert main(["--model", "llama-3-70b", "--tp", "4", "--decode-tp", "2", "--kv-only", "--context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "P tp=4 -> D tp=2 (8 KV heads): 4 rank-to-rank reads, each D rank from 2 P rank(s), head slices" in out
    assert main(["--model", "llama-3-70b", "--decode-tp", "2", "--kv-only"]) == 2
    assert "--decode-tp needs --tp" in capsys.readouterr().err
