"""pdserve.vllm.params: connector config, kv_transfer_params schema, block planning.

Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

import pytest

from pdserve.vllm.params import (
    BlockPlan,
    ConfigError,
    ConnectorConfig,
    LayerGeometry,
    RemoteParams,
    build_entries,
    layout_signature,
    plan_blocks,
    prompt_hash,
)

SECRET = "0123456789abcdef-secret"


def test_config_defaults_and_env_secret():
    cfg = ConnectorConfig.from_extra({}, env={"PDSERVE_TRANSFER_SECRET": SECRET})
    assert cfg.secret == SECRET and cfg.lease_s == 30.0 and cfg.transfer_port == 0
    assert cfg.backend == "auto" and cfg.on_load_failure == "recompute" and not cfg.allow_test_faults
    assert cfg.port_for_rank(3) == 0
    cfg = ConnectorConfig.from_extra({"secret": SECRET, "transfer_port": 20000, "lease_s": "2.5"}, env={})
    assert cfg.port_for_rank(1) == 20001 and cfg.lease_s == 2.5


@pytest.mark.parametrize("extra, needle", [
    ({}, "PDSERVE_TRANSFER_SECRET"),
    ({"secret": "short"}, "at least 16"),
    ({"secret": SECRET, "lease_s": 0}, "lease_s"),
    ({"secret": SECRET, "lease_s": "soon"}, "lease_s"),
    ({"secret": SECRET, "transfer_port": 70000}, "transfer_port"),
    ({"secret": SECRET, "transfer_port": True}, "transfer_port"),
    ({"secret": SECRET, "backend": "rdma"}, "backend"),
    ({"secret": SECRET, "on_load_failure": "retry"}, "on_load_failure"),
    ({"secret": SECRET, "allow_test_faults": "maybe"}, "allow_test_faults"),
    ({"secret": SECRET, "transfer_host": "0.0.0.0"}, "advertise_host"),
    ({"secret": SECRET, "leas_s": 3}, "unknown keys"),
])
def test_config_errors_are_actionable(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        ConnectorConfig.from_extra(extra, env={})


def _params(**over):
    p = RemoteParams("eng", "127.0.0.1", 5555, (7, 8, 9), 300, "req-1", "lay", prompt_hash(list(range(300)), 300),
                     123.0).to_params()
    p.update(over)
    return p


def test_remote_params_round_trip():
    p = _params()
    assert p["do_remote_prefill"] is True and p["remote_block_ids"] == [7, 8, 9]
    r = RemoteParams.parse(p, 128)
    assert r.block_ids == (7, 8, 9) and r.num_tokens == 300 and r.request_id == "req-1"
    assert r.lease_deadline == 123.0 and r.test_fault == ""
    assert RemoteParams.parse(dict(p, pdserve_test_fault="zero"), 128).test_fault == "zero"


@pytest.mark.parametrize("over, needle", [
    ({"do_remote_prefill": False}, "not a remote-prefill"),
    ({"remote_host": None}, "remote_host"),
    ({"remote_block_ids": [1, 2]}, "cannot hold"),
    ({"remote_num_tokens": "x"}, "malformed"),
    ({"remote_port": 0}, "port"),
])
def test_remote_params_rejects_bad_input(over, needle):
    with pytest.raises(ValueError, match=needle):
        RemoteParams.parse(_params(**over), 128)


def test_prompt_hash_depends_on_prefix_only():
    a = list(range(1000))
    assert prompt_hash(a, 900) == prompt_hash(a + [5], 900)
    assert prompt_hash(a, 900) != prompt_hash(a, 899)
    b = list(a)
    b[3] = 99999
    assert prompt_hash(a, 900) != prompt_hash(b, 900)


def test_plan_blocks_skips_local_hits():
    local = [10, 11, 12, 13, 14]
    remote = [20, 21, 22, 23]
    # no local hit: 300 tokens = blocks 0..2
    assert plan_blocks(local, 0, 300, remote, 128) == BlockPlan((10, 11, 12), (20, 21, 22))
    # two blocks cached on D: read only block 2 (tokens 256..299)
    assert plan_blocks(local, 256, 44, remote, 128) == BlockPlan((12,), (22,))
    with pytest.raises(ValueError, match="multiple"):
        plan_blocks(local, 100, 44, remote, 128)
    with pytest.raises(ValueError, match="plan needs"):
        plan_blocks(local, 0, 600, remote, 128)


def test_build_entries_one_per_layer_per_block_and_merge_friendly():
    layers = [LayerGeometry("l0", 1000, 1000), LayerGeometry("l1", 1000, 1000)]
    entries = build_entries(layers, BlockPlan((3, 4), (8, 9)))
    assert entries == [("l0", 3000, "l0", 8000, 1000), ("l0", 4000, "l0", 9000, 1000),
                       ("l1", 3000, "l1", 8000, 1000), ("l1", 4000, "l1", 9000, 1000)]
    from pdserve.transfer import TransferEntry, merge_contiguous
    merged = merge_contiguous(TransferEntry(*e) for e in entries)
    assert len(merged) == 2 and merged[0].length == 2000


def test_layout_signature():
    a = [LayerGeometry("l0", 10, 10), LayerGeometry("l1", 10, 10)]
    assert layout_signature("float32", a, 128) == layout_signature("float32", list(reversed(a)), 128)
    assert layout_signature("float32", a, 128) != layout_signature("bfloat16", a, 128)
    assert layout_signature("float32", a, 128) != layout_signature("float32", a[:1], 128)
