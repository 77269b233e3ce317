"""A small random Qwen3-MoE-shaped model for tests and benchmarks of expert parallelism (issue 36).

    python -m pdserve.launch.models_moe OUT_DIR [--layers 3] [--experts 8] [--seed 0]

``Qwen3MoeForCausalLM`` built with ``transformers``' ``Qwen3MoeConfig``: grouped-query attention (4 heads, 2 KV
heads of 32, so TP 2 splits them) and a routed MoE block in every layer (``experts`` experts, top 2, no shared
expert), the SmolLM2 tokenizer, random weights scaled as :func:`pdserve.launch.models.build_random_llama` scales
them (greedy decoding is decisive). fp32. Deterministic for a seed; idempotent; built once per run under
``PDSERVE_MODEL_CACHE``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .models import build_random, init_random_weights


def build_random_qwen3_moe(out_dir: str | os.PathLike[str], layers: int = 3, hidden: int = 128, experts: int = 8,
                           top_k: int = 2, seed: int = 0, init_std: float = 0.2, lm_head_std: float = 2.0,
                           tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write a small fp32 ``Qwen3MoeForCausalLM`` with random weights and the SmolLM2 tokenizer."""
    stamp = {"kind": "random_qwen3_moe", "layers": layers, "hidden": hidden, "experts": experts, "top_k": top_k,
             "seed": seed, "init_std": init_std, "lm_head_std": lm_head_std, "version": 1}
    return build_random(out_dir, stamp, tokenizer_dir, lambda folder, tokenizer: _write(folder, stamp, tokenizer))


def _config(stamp: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import Qwen3MoeConfig

    hidden = stamp["hidden"]
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=stamp["layers"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=stamp["experts"], num_experts_per_tok=stamp["top_k"],
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        rms_norm_eps=1e-5, initializer_range=stamp["init_std"], tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def _write(folder: Path, stamp: dict[str, Any], tokenizer: Any) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    config = _config(stamp, tokenizer)
    torch.manual_seed(stamp["seed"])
    model = Qwen3MoeForCausalLM(config)
    init_random_weights(model, stamp["seed"], stamp["init_std"], stamp["lm_head_std"])
    model.to(torch.float32).save_pretrained(str(folder), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launch.models_moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_random_qwen3_moe(args.out_dir, layers=args.layers, experts=args.experts, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
