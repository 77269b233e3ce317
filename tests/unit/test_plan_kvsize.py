"""KV calculator against hand-computed sizes."""

import json
from pathlib import Path

import pytest

from pdserve.plan.kvsize import ModelConfigError, estimate_params, load_model, load_presets, spec_from_config

KIB, GIB = 1024, 1024 ** 3


def test_llama3_70b_is_320_kib_per_token_and_40_gib_at_128k():
    m = load_model("llama-3-70b")
    # 2 (K and V) x 80 layers x 8 KV heads x 128 dims x 2 bytes
    assert m.kv_bytes_per_token("bf16") == 2 * 80 * 8 * 128 * 2 == 320 * KIB
    assert m.kv_bytes(128 * 1024, "bf16") == 40 * GIB
    assert m.kv_bytes(128 * 1024, "fp8") == 20 * GIB


def test_mimo_v2_flash_at_256k_keeps_only_the_window_on_sliding_layers():
    m = load_model("mimo-v2-flash")
    kinds = {g.kind: g for g in m.groups}
    assert kinds["full"].layers == 9 and kinds["sliding"].layers == 39
    ctx = 256 * 1024
    full = 9 * 4 * (192 + 128) * 2 * ctx  # 9 full layers, 4 KV heads, K 192 + V 128, bf16, whole context
    window = 39 * 8 * (192 + 128) * 2 * 128  # 39 window layers, 8 KV heads, only 128 tokens kept
    assert m.kv_bytes(ctx) == full + window == 6_065_356_800
    assert m.kv_bytes_per_token_long() == 9 * 4 * 320 * 2
    # below the window every layer grows with the context
    assert m.kv_bytes(100) == 100 * (9 * 4 + 39 * 8) * 320 * 2


def test_deepseek_v3_mla_caches_one_latent_per_layer():
    m = load_model("deepseek-v3")
    assert m.groups[0].kind == "mla"
    assert m.kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2
    assert m.kv_bytes_per_token("fp8") == 61 * 576


def test_layer_types_hybrid_and_mistral_style_window():
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "intermediate_size": 1024, "vocab_size": 1000, "sliding_window": 16,
           "layer_types": ["sliding_attention", "full_attention"] * 2}
    m = spec_from_config(cfg)
    per_layer = 2 * 2 * 64 * 2  # K+V, 2 heads, head dim 64, bf16
    assert m.kv_bytes(1000) == 2 * per_layer * 1000 + 2 * per_layer * 16
    cfg2 = dict(cfg)
    del cfg2["layer_types"]
    assert spec_from_config(cfg2).kv_bytes(1000) == 4 * per_layer * 16  # every layer windowed
    cfg2["use_sliding_window"] = False
    assert spec_from_config(cfg2).kv_bytes(1000) == 4 * per_layer * 1000


def test_moe_changes_weights_not_kv():
    q = load_model("qwen3-235b-a22b")
    assert q.is_moe and q.num_experts == 128 and q.experts_per_token == 8
    assert q.kv_bytes_per_token() == 2 * 94 * 4 * 128 * 2
    assert q.active_params < q.total_params / 5


@pytest.mark.parametrize("name", sorted(load_presets()))
def test_parameter_estimate_matches_published_counts(name):
    p = load_presets()[name]
    total, active, _ = estimate_params(p["config"])
    assert abs(total - p["total_params"]) / p["total_params"] < 0.02
    assert abs(active - p["active_params"]) / p["active_params"] < 0.15


def test_reads_a_config_json_folder(tmp_path: Path):
    cfg = load_presets()["smollm2-135m"]["config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path))
    assert m.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2
    with pytest.raises(ModelConfigError, match="neither a preset"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        spec_from_config({"hidden_size": 8})
