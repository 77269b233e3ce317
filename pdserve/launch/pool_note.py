"""Whether pdserve's KV pool serves a launch's model, said in one line at start-up and in ``--dry-run``.

pdserve's pool stores one object per block position, keyed by the tokens up to that block, holding one
full-attention KV block of every layer (pdserve/vllm/pool.py). Under vLLM's hybrid KV cache manager a model's
blocks come in groups (sliding window, Mamba / linear-attention state: pdserve/vllm/groups.py), so each worker
turns the pool off for such a model (``PdserveConnector: KV pool off on this worker``) and P -> D hand-offs move
every group without it. The launch says so before the workers start, not only in their logs. What pooling a hybrid
cache still needs: docs/architecture.md, "Hybrid KV caches", *Limits*.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import LauncherConfig
from .plane_limits import model_config, state_layers


def window_layers(cfg: dict[str, Any]) -> str:
    """What in a model's config.json names sliding-window layers ("" none): ``layer_types`` (Gemma 3, gpt-oss)
    or MiMo's ``hybrid_layer_pattern``."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and window_layers(text):
        return window_layers(text)
    types = cfg.get("layer_types")
    if isinstance(types, list) and "sliding_attention" in types:
        return f"{types.count('sliding_attention')} of {len(types)} layers in layer_types slide"
    pattern = cfg.get("hybrid_layer_pattern")
    if isinstance(pattern, list) and 1 in pattern:
        return f"{pattern.count(1)} sliding-window layers in hybrid_layer_pattern"
    return ""


def pool_note(config: LauncherConfig, model_dir: str | Path) -> str:
    """One line when the launch asks for pdserve's pool and the model's KV cache is hybrid ("" otherwise)."""
    if not (config.pool and config.pool_backend == "pdserve" and config.connector and config.kv_connector == "pdserve"):
        return ""
    cfg = model_config(model_dir)
    groups = "; ".join(g for g in (window_layers(cfg), state_layers(cfg)) if g)
    if not groups:
        return ""
    return (f"kv pool: off on every worker for this model: its KV cache is hybrid ({groups}), and pdserve's pool "
            "stores one full-attention block per block key; P -> D hand-offs move every KV cache group without it "
            "(--no-pool skips starting the pool's processes)")
