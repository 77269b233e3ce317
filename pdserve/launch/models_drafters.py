"""Small drafters for tests and benchmarks of speculative decoding across the hand-off (issue 36, item 4): EAGLE and
EAGLE-3 heads for a Llama target, and :func:`drafter_stack`, a target with a drafter for each of vLLM's methods
with layers (``draft_model``, ``eagle``, ``eagle3``, ``mtp``), one that mirrors its target where that can be built
(:data:`MIRRORED`).

    python -m pdserve.launch.models_drafters OUT_DIR TARGET_DIR [--seed 1] [--mirror]

The checkpoint vLLM's ``eagle`` method loads (``EagleLlamaForCausalLM``, vllm/model_executor/models/llama_eagle.py):
a ``LlamaConfig`` of one decoder layer shaped as the target's, and weights named without the ``model.`` prefix:
``fc`` (the next token's embedding and the target's hidden state, 2 x hidden -> hidden) and ``layers.0.*``
without the first layer's input norm. The embedding and the output head are the target's (vLLM shares them when
the drafter has none). The drafter's attention layer keeps KV of its own, which vLLM allocates beside the target's.

- Random (default): weights scaled as :func:`pdserve.launch.models.build_random_llama` scales them; its drafts are
  rarely accepted.
- ``mirror``: the drafter is the target itself, for a one-layer target built with ``unit_embeddings``: ``fc``
  passes the embedding through and drops the hidden state, and layer 0 is the target's (whose input norm is the
  identity on unit-RMS embeddings, up to its epsilon). Fed token ``i + 1`` at position ``i`` (RoPE sees the same
  relative positions), it predicts what the target predicts, so every draft is accepted, as long as the drafter's
  own KV for the earlier tokens is right: a test of the drafter's KV that acceptance reads.

Deterministic for a seed; idempotent; built once per run under ``PDSERVE_MODEL_CACHE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from .models import build_random, build_random_llama, embedding_passthrough, init_random_weights
from .plane_limits import NATIVE_ROPE

DRAFTER_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# the drafters that mirror their target (every draft accepted where the drafter's KV is right); EAGLE-3's layer adds
# the target's hidden states to its residual stream, so no copy of the target makes one
MIRRORED = frozenset({"draft_model", "eagle", "mtp"})

SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "rms_norm_eps", "rope_theta", "bos_token_id", "eos_token_id",
              "pad_token_id")
UNIT_RMS_TOLERANCE = 1e-3


def build_random_eagle(out_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str], seed: int = 1,
                       init_std: float = 0.2, mirror: bool = False,
                       tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write a one-layer EAGLE drafter shaped for the Llama at ``target_dir``: random, or (``mirror``) the target's
    own layer (a one-layer target with unit-RMS embeddings; ValueError otherwise)."""
    target = _llama_config(target_dir, "EAGLE")
    if mirror and target.get("num_hidden_layers") != 1:
        raise ValueError(f"{target_dir}: {target.get('num_hidden_layers')} layers; a mirror drafter copies a "
                         "one-layer target (build_random_llama(layers=1, unit_embeddings=True))")
    shape = {key: target.get(key) for key in SHAPE_KEYS}
    stamp = {"kind": "random_eagle", "target": shape, "dtype": target.get("dtype", "float32"), "seed": seed,
             "init_std": init_std, "version": 1}
    if mirror:
        stamp.update(mirror=True, target_dir=str(Path(target_dir).resolve()))
    return build_random(out_dir, stamp, tokenizer_dir, lambda folder, tokenizer: _write(folder, stamp))


def build_random_eagle3(out_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str], seed: int = 3,
                        init_std: float = 0.2, tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write a random EAGLE-3 head shaped for the Llama at ``target_dir``: the checkpoint vLLM's ``eagle3`` method
    loads (``Eagle3LlamaForCausalLM``, vllm/model_executor/models/llama_eagle3.py): ``fc`` (three of the target's
    hidden states -> hidden), ``midlayer.*`` (attention over the next token's embedding and ``fc``'s output side
    by side: q/k/v take 2 x hidden; ``hidden_norm`` beside ``input_layernorm``), ``norm`` and its own ``lm_head``
    over the target's vocabulary (no draft vocabulary map), and the config names the three target layers whose
    hidden states ``fc`` joins (``eagle_aux_hidden_state_layer_ids``). Random weights: its drafts are rarely
    accepted. ValueError for a target of fewer than 4 layers."""
    target = _llama_config(target_dir, "EAGLE-3")
    layers = int(target.get("num_hidden_layers") or 0)
    if layers < 4:
        raise ValueError(f"{target_dir}: {layers} layers; EAGLE-3 reads three distinct target layers, use 4 or more")
    stamp = {"kind": "random_eagle3", "target": {key: target.get(key) for key in SHAPE_KEYS},
             "aux_layers": [1, layers // 2, layers - 1], "dtype": target.get("dtype", "float32"), "seed": seed,
             "init_std": init_std, "version": 1}
    return build_random(out_dir, stamp, tokenizer_dir, lambda folder, tokenizer: _write_eagle3(folder, stamp))


def _llama_config(target_dir: str | os.PathLike[str], drafter: str) -> dict[str, Any]:
    """The config of the Llama target at ``target_dir`` (ValueError for another model type)."""
    target: dict[str, Any] = json.loads((Path(target_dir) / "config.json").read_text())
    if target.get("model_type") != "llama":
        raise ValueError(f"{target_dir}: model_type {target.get('model_type')!r}; the {drafter} drafter here is for "
                         "a Llama target")
    return target


def _write_eagle3(folder: Path, stamp: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file

    config = _config(stamp)
    config.architectures = ["LlamaForCausalLMEagle3"]  # vLLM's eagle3 method keeps a name that ends so
    # which target layers' hidden states fc joins; vLLM's default for a Llama, (2, L // 2, L - 3), repeats a layer
    # below 8 layers, and then fc gets two states where it takes three
    config.eagle_aux_hidden_state_layer_ids = stamp["aux_layers"]
    h, heads, kv, inter = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                           config.intermediate_size)
    head, vocab = h // heads, config.vocab_size
    generator = torch.Generator().manual_seed(stamp["seed"])
    shapes = {"midlayer.self_attn.q_proj.weight": (heads * head, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv * head, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv * head, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, heads * head), "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
              "fc.weight": (h, 3 * h), "lm_head.weight": (vocab, h)}
    dtype = getattr(torch, stamp["dtype"])
    weights = {name: (torch.randn(shape, generator=generator) * stamp["init_std"]).to(dtype)
               for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        weights[norm + ".weight"] = torch.ones(h, dtype=dtype)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))


def _write(folder: Path, stamp: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    config = _config(stamp)
    weights = _mirror_weights(Path(stamp["target_dir"])) if stamp.get("mirror") else _random_weights(config, stamp)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))


def _config(stamp: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    shape = {k: v for k, v in stamp["target"].items() if v is not None}
    config = LlamaConfig(**shape, num_hidden_layers=1, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]  # vLLM's eagle method names it EagleLlamaForCausalLM
    config.dtype = stamp["dtype"]
    return config


def _random_weights(config: Any, stamp: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(stamp["seed"])
    layer = LlamaForCausalLM(config)
    init_random_weights(layer, stamp["seed"], stamp["init_std"], stamp["init_std"])
    dtype = getattr(torch, stamp["dtype"])
    weights = {name[len("model."):]: value.to(dtype).contiguous() for name, value in layer.state_dict().items()
               if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    generator = torch.Generator().manual_seed(stamp["seed"] + 1)
    hidden = config.hidden_size
    weights["fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=generator) * stamp["init_std"]).to(dtype)
    return weights


def _mirror_weights(target_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    target = load_file(str(target_dir / "model.safetensors"))
    table = target["model.embed_tokens.weight"].float()
    worst = float((table.pow(2).mean(-1).sqrt() - 1).abs().max())
    if worst > UNIT_RMS_TOLERANCE:
        raise ValueError(f"{target_dir}: embedding rows off RMS 1 by up to {worst:.3g}; a mirror drafter needs "
                         "build_random_llama(layers=1, unit_embeddings=True)")
    weights = {name[len("model."):]: value.contiguous() for name, value in target.items()
               if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    hidden, dtype = table.shape[1], target["model.embed_tokens.weight"].dtype
    weights["fc.weight"] = embedding_passthrough(hidden, dtype)
    return weights


def drafter_stack(method: str, folder: str | os.PathLike[str],
                  tokenizer_dir: str | os.PathLike[str] | None = None) -> tuple[Path, dict[str, Any], tuple[str, ...]]:
    """A random target, vLLM's ``--speculative-config`` for a drafter of ``method``, and the vLLM arguments its
    workers need on CPU, built under ``folder``:

    - ``draft_model``: a 2-layer Llama drafting 2 tokens for itself;
    - ``eagle``: a one-layer Llama (unit-RMS embeddings) and an EAGLE head copying it, 2 tokens;
    - ``eagle3``: a 4-layer Llama and a random EAGLE-3 head (:func:`build_random_eagle3`), 2 tokens: not a
      mirror, its drafts are rarely accepted;
    - ``mtp``: a one-layer DeepSeek-V3 (MLA) whose MTP layer copies layer 0, 1 token, with vLLM's PyTorch rotary
      (its CPU kernel writes MLA's k_pe otherwise in one-token and multi-token passes, so the MTP layer's one-token
      drafts would not mirror the prompt's KV: docs/architecture.md, MLA).

    Each mirror (:data:`MIRRORED`) predicts what its target predicts when its attention over the earlier tokens
    reads the right KV of its own layers, so acceptance measures that KV."""
    root = Path(folder)
    if method == "draft_model":
        target = build_random_llama(root / "target2", layers=2, tokenizer_dir=tokenizer_dir)
        return target, {"method": method, "model": str(target), "num_speculative_tokens": 2}, ()
    if method == "eagle":
        target = build_random_llama(root / "target1", layers=1, unit_embeddings=True, tokenizer_dir=tokenizer_dir)
        draft = build_random_eagle(root / "eagle", target, mirror=True, tokenizer_dir=tokenizer_dir)
        return target, {"method": method, "model": str(draft), "num_speculative_tokens": 2}, ()
    if method == "eagle3":
        target = build_random_llama(root / "target4", layers=4, tokenizer_dir=tokenizer_dir)
        draft = build_random_eagle3(root / "eagle3", target, tokenizer_dir=tokenizer_dir)
        return target, {"method": method, "model": str(draft), "num_speculative_tokens": 2}, ()
    if method == "mtp":
        from .models_mla import build_random_deepseek_v3

        model = build_random_deepseek_v3(root / "ds3-mtp", layers=1, mtp_layers=1, mtp_mirror=True,
                                         tokenizer_dir=tokenizer_dir)
        return model, {"method": method, "num_speculative_tokens": 1}, (NATIVE_ROPE,)
    raise ValueError(f"method {method!r}: use one of {', '.join(DRAFTER_METHODS)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launch.models_drafters",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("target_dir")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mirror", action="store_true", help="copy a one-layer target with unit-RMS embeddings")
    args = parser.parse_args(argv)
    print(build_random_eagle(args.out_dir, args.target_dir, seed=args.seed, mirror=args.mirror))
    return 0


if __name__ == "__main__":
    sys.exit(main())
