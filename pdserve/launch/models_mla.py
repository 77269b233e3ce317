"""A small random DeepSeek-V3-shaped model (MLA + MoE) for tests and benchmarks.

    python -m pdserve.launch.models_mla OUT_DIR [--layers 3] [--dtype float32] [--seed 0] [--mtp-layers 0]

``DeepseekV3ForCausalLM`` built with ``transformers``' ``DeepseekV3Config``: multi-head latent attention (one
576-wide latent per token and layer: ``kv_lora_rank`` 512 + rope 64, the only width vLLM's CPU MLA kernel
compiles for), a dense first layer and routed + shared experts after it, the SmolLM2 tokenizer, random weights
scaled as :func:`pdserve.launch.models.build_random_llama` scales them, so greedy decoding is decisive and a wrong KV
changes the output. Deterministic for a seed; idempotent; built once per run under ``PDSERVE_MODEL_CACHE``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .models import build_random, embedding_passthrough, init_random_weights, unit_rms_rows

KV_LORA_RANK = 512  # vLLM's CPU MLA decode kernel: kv_lora_rank 512 + rope 64 = 576
ROPE_DIM = 64


def build_random_deepseek_v3(out_dir: str | os.PathLike[str], layers: int = 3, hidden: int = 256,
                             heads: int = 4, experts: int = 8, top_k: int = 2, dtype: str = "float32",
                             seed: int = 0, init_std: float = 0.2, lm_head_std: float = 2.0,
                             tokenizer_dir: str | os.PathLike[str] | None = None, mtp_layers: int = 0,
                             mtp_mirror: bool = False) -> Path:
    """Write a small ``DeepseekV3ForCausalLM`` (MLA + MoE) with random weights and the SmolLM2 tokenizer;
    ``mtp_layers``: multi-token-prediction layers after the ``layers`` (DeepSeek-V3's checkpoint layout, which
    vLLM's ``mtp`` speculative method loads). ``mtp_mirror``: one dense layer and one MTP layer that is its copy
    (unit-RMS embeddings, so the MTP layer's embedding norm passes them through but for its epsilon, and an
    ``eh_proj`` that keeps the embedding and drops the hidden state): fed token ``i + 1`` at position ``i``, the
    MTP layer predicts what the model predicts, so its drafts are accepted as long as its own KV for the earlier
    tokens is right."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype {dtype!r}: use float32 or bfloat16")
    if mtp_mirror and (layers, mtp_layers) != (1, 1):
        raise ValueError(f"mtp_mirror with layers={layers}, mtp_layers={mtp_layers}: use layers=1, mtp_layers=1")
    if layers < 2 and not mtp_mirror:
        raise ValueError(f"layers={layers}: use 2 or more (layer 0 is dense, the rest are MoE)")
    if mtp_layers < 0:
        raise ValueError(f"mtp_layers={mtp_layers}: use 0 (none) or more")
    stamp = {"kind": "random_deepseek_v3", "layers": layers, "hidden": hidden, "heads": heads,
             "experts": experts, "top_k": top_k, "dtype": dtype, "seed": seed, "init_std": init_std,
             "lm_head_std": lm_head_std, "version": 1}
    if mtp_layers:  # only then: the folders built without MTP keep their stamp
        stamp["mtp_layers"] = mtp_layers
    if mtp_mirror:
        stamp["mtp_mirror"] = True
    return build_random(out_dir, stamp, tokenizer_dir, lambda folder, tokenizer: _write(folder, stamp, tokenizer))


def _config(stamp: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import DeepseekV3Config

    hidden, heads = stamp["hidden"], stamp["heads"]
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=stamp["layers"], num_attention_heads=heads,
        num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=stamp["experts"],
        num_experts_per_tok=stamp["top_k"], n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, kv_lora_rank=KV_LORA_RANK, q_lora_rank=hidden // 2,
        qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=32, v_head_dim=32, head_dim=ROPE_DIM,
        max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=stamp["init_std"],
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, num_nextn_predict_layers=0,
        first_k_dense_replace=stamp["layers"] if stamp.get("mtp_mirror") else 1,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"  # DeepSeek-V3's router, as vLLM reads it
    return config


def _write(folder: Path, stamp: dict[str, Any], tokenizer: Any) -> None:
    import torch
    from transformers import DeepseekV3ForCausalLM

    mtp = stamp.get("mtp_layers", 0)
    config = _config({**stamp, "layers": stamp["layers"] + mtp}, tokenizer)
    torch.manual_seed(stamp["seed"])
    model = DeepseekV3ForCausalLM(config)
    init_random_weights(model, stamp["seed"], stamp["init_std"], stamp["lm_head_std"],
                        zeros=("e_score_correction_bias",))  # DeepSeek-V3's router bias starts at 0
    if stamp.get("mtp_mirror"):
        unit_rms_rows(model.model.embed_tokens.weight)
    model.to(getattr(torch, stamp["dtype"])).save_pretrained(str(folder), safe_serialization=True)
    if mtp:
        _add_mtp(folder, stamp)


def _add_mtp(folder: Path, stamp: dict[str, Any]) -> None:
    """The last ``mtp_layers`` decoder layers saved become MTP layers: each gets the parts DeepSeek-V3's MTP module
    adds (``enorm``/``hnorm`` over the next token's embedding and the previous hidden state, ``eh_proj`` joining
    them, ``shared_head`` norm and output head), and the config counts them in ``num_nextn_predict_layers``."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    layers, mtp, hidden = stamp["layers"], stamp["mtp_layers"], stamp["hidden"]
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    generator = torch.Generator().manual_seed(stamp["seed"] + 1)
    dtype = weights["lm_head.weight"].dtype
    for index in range(layers, layers + mtp):
        prefix = f"model.layers.{index}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            weights[prefix + norm + ".weight"] = torch.ones(hidden, dtype=dtype)
        weights[prefix + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=generator)
                                              * stamp["init_std"]).to(dtype)
        weights[prefix + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    if stamp.get("mtp_mirror"):  # the MTP layer is layer 0; eh_proj keeps the embedding, drops the hidden state
        for name in [n for n in weights if n.startswith("model.layers.0.")]:
            weights["model.layers.1." + name[len("model.layers.0."):]] = weights[name].clone()
        weights["model.layers.1.eh_proj.weight"] = embedding_passthrough(hidden, dtype)
    save_file(weights, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=mtp)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launch.models_mla", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp-layers", type=int, default=0, help="multi-token-prediction layers (vLLM's mtp method)")
    args = parser.parse_args(argv)
    print(build_random_deepseek_v3(args.out_dir, layers=args.layers, dtype=args.dtype, seed=args.seed,
                                   mtp_layers=args.mtp_layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
