"""Tiny random models of the hybrid KV cache families, for tests and benchmarks (issue 36).

    python -m pdserve.launch.model_families FAMILY OUT_DIR    # FAMILY: one of FAMILIES

Each family is a ``transformers`` config of the real architecture shrunk to a few layers and small hidden sizes
(as vLLM's own tests build them), random weights with a large init so greedy decoding is decisive, and the SmolLM2
tokenizer of :mod:`pdserve.launch.models`:

* ``gemma3``: Gemma 3 text, sliding window on 3 of 4 layers (fp32);
* ``gptoss``: gpt-oss, sliding window on every other layer, attention sinks, MoE (fp32);
* ``qwen3next``: Qwen3-Next, gated delta-net linear attention on 3 of 4 layers + full attention, MoE (bf16:
  vLLM's CPU gated delta-net kernel needs it);
* ``granitehybrid``: Granite-4 hybrid, Mamba2 on 3 of 4 layers + attention, MoE (fp32).

Idempotent: a folder whose stamp matches the requested build is returned as is.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .models import init_random_weights, save_model_folder, stamp_matches, tokenizer_source

WINDOW = 128  # the sliding-window families' window (tokens)


@dataclass(frozen=True)
class Family:
    """One model family: its transformers config and model classes, their arguments and the dtype to serve."""

    config_class: str
    model_class: str
    dtype: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    sliding_window: int = 0  # tokens (0: no sliding-window layers)
    kind: str = ""  # what its KV cache groups are, for tables
    worker_args: tuple[str, ...] = ()  # vLLM arguments plain vLLM needs for it on CPU (see FAMILIES)


_ATTN = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 8192, "num_hidden_layers": 4}

FAMILIES: dict[str, Family] = {
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", "float32", {
        **_ATTN, "intermediate_size": 256, "sliding_window": WINDOW, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "tie_word_embeddings": True},
        WINDOW, "sliding window 3:1 + full"),
    "gptoss": Family("GptOssConfig", "GptOssForCausalLM", "float32", {
        **_ATTN, "intermediate_size": 128, "sliding_window": WINDOW, "num_local_experts": 4,
        "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"] * 2},
        WINDOW, "sliding window 1:1 + full, sinks, MoE"),
    "qwen3next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM", "bfloat16", {
        **_ATTN, "intermediate_size": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
        0, "gated delta-net 3:1 + full, MoE"),
    "granitehybrid": Family("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "float32", {
        "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "max_position_embeddings": 8192, "intermediate_size": 128, "shared_intermediate_size": 128,
        "num_local_experts": 4, "num_experts_per_tok": 2, "mamba_n_heads": 4, "mamba_d_head": 64,
        "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 64,
        "layer_types": ["mamba", "mamba", "attention", "mamba"], "position_embedding_type": "rope"},
        0, "Mamba2 3:1 + attention, MoE",
        # vLLM 0.32's CPU Mamba2 kernel returns no intermediate states, which its prefix caching (mamba_cache_mode
        # "align") indexes: a prompt crashes the engine ("index 4 is out of bounds"), with or without pdserve
        ("--no-enable-prefix-caching",)),
}


def build_family(family: str, out_dir: str | os.PathLike[str], seed: int = 0, init_std: float = 0.2,
                 lm_head_std: float = 2.0, tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write the tiny random model of ``family`` (a key of :data:`FAMILIES`) to ``out_dir``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: use one of {sorted(FAMILIES)}")
    spec = FAMILIES[family]
    out = Path(out_dir)
    stamp = {"kind": f"family_{family}", "seed": seed, "init_std": init_std, "lm_head_std": lm_head_std,
             "kwargs": spec.kwargs, "dtype": spec.dtype, "version": 1}
    if stamp_matches(out, stamp):
        return out
    return _build(spec, out, stamp, tokenizer_dir)


def _build(spec: Family, out: Path, stamp: dict[str, Any], tokenizer_dir: str | os.PathLike[str] | None) -> Path:
    import torch
    import transformers

    tokenizer = tokenizer_source(tokenizer_dir)
    config = getattr(transformers, spec.config_class)(
        vocab_size=len(tokenizer), rms_norm_eps=1e-5, initializer_range=stamp["init_std"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **spec.kwargs)
    config.architectures = [spec.model_class]
    torch.manual_seed(stamp["seed"])
    model = getattr(transformers, spec.model_class)(config)
    init_random_weights(model, stamp["seed"], stamp["init_std"], stamp["lm_head_std"])
    return save_model_folder(model.to(getattr(torch, spec.dtype)), tokenizer, out, stamp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.launch.model_families", description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=sorted(FAMILIES))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(build_family(args.family, args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
