"""A small random DeepSeek-V3-shaped model (MLA + MoE) for tests and benchmarks.

    python -m pdserve.launch.models_mla OUT_DIR [--layers 3] [--dtype float32] [--seed 0]

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

from .models import build_random, init_random_weights

KV_LORA_RANK = 512  # vLLM's CPU MLA decode kernel: kv_lora_rank 512 + rope 64 = 576
ROPE_DIM = 64


def build_random_deepseek_v3(out_dir: str | os.PathLike[str], layers: int = 3, hidden: int = 256,
                             heads: int = 4, experts: int = 8, top_k: int = 2, dtype: str = "float32",
                             seed: int = 0, init_std: float = 0.2, lm_head_std: float = 2.0,
                             tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write a small ``DeepseekV3ForCausalLM`` (MLA + MoE) with random weights and the SmolLM2 tokenizer."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype {dtype!r}: use float32 or bfloat16")
    if layers < 2:
        raise ValueError(f"layers={layers}: use 2 or more (layer 0 is dense, the rest are MoE)")
    stamp = {"kind": "random_deepseek_v3", "layers": layers, "hidden": hidden, "heads": heads,
             "experts": experts, "top_k": top_k, "dtype": dtype, "seed": seed, "init_std": init_std,
             "lm_head_std": lm_head_std, "version": 1}
    return build_random(out_dir, stamp, tokenizer_dir, lambda folder, tokenizer: _write(folder, stamp, tokenizer))


def _config(stamp: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import DeepseekV3Config

    hidden, heads = stamp["hidden"], stamp["heads"]
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=stamp["layers"], num_attention_heads=heads,
        num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=stamp["experts"],
        num_experts_per_tok=stamp["top_k"], n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, kv_lora_rank=KV_LORA_RANK, q_lora_rank=hidden // 2,
        qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=32, v_head_dim=32, head_dim=ROPE_DIM,
        max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=stamp["init_std"],
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, num_nextn_predict_layers=0,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"  # DeepSeek-V3's router, as vLLM reads it
    return config


def _write(folder: Path, stamp: dict[str, Any], tokenizer: Any) -> None:
    import torch
    from transformers import DeepseekV3ForCausalLM

    config = _config(stamp, tokenizer)
    torch.manual_seed(stamp["seed"])
    model = DeepseekV3ForCausalLM(config)
    init_random_weights(model, stamp["seed"], stamp["init_std"], stamp["lm_head_std"],
                        zeros=("e_score_correction_bias",))  # DeepSeek-V3's router bias starts at 0
    model.to(getattr(torch, stamp["dtype"])).save_pretrained(str(folder), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launch.models_mla", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_random_deepseek_v3(args.out_dir, layers=args.layers, dtype=args.dtype, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
