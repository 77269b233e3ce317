"""What the launch says, or refuses, about the KV pool for a model whose KV cache is hybrid (sliding window, Mamba /
linear attention): one line at start-up and in ``--dry-run``, or a ConfigError before anything starts.

pdserve's pool takes hybrid caches (pdserve/vllm/pool_groups.py: every KV cache group's blocks, a Mamba state only
at the lengths vLLM's own prefix caching caches). A worker whose engine has prefix caching off uses no pool
(pdserve/vllm/scheduler.py: never computes on top of KV its engine would not reuse): for a Mamba model on CPU that
is the usual case (Granite-4 hybrid: vLLM 0.32's CPU Mamba2 kernel crashes under prefix caching, so such workers run
with ``--no-enable-prefix-caching``), and the launch says so. Mooncake Store as the pool (vLLM's
MooncakeStoreConnector) refuses a Mamba group outside ``mamba_cache_mode`` align, which prefix caching off leaves
("MooncakeStoreConnector does not support: group N: mamba_cache_mode='none' != 'align'", at every worker's start):
the launch refuses it first, with what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import ConfigError, LauncherConfig
from .plane_limits import model_config, state_layers

PREFIX_CACHING_FLAGS = ("--enable-prefix-caching", "--no-enable-prefix-caching")


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


def prefix_caching_off(args: Sequence[str]) -> bool:
    """Whether vLLM arguments turn prefix caching off (the last of the two flags wins)."""
    last = [a for a in args if a in PREFIX_CACHING_FLAGS]
    return bool(last) and last[-1] == "--no-enable-prefix-caching"


def _off_roles(config: LauncherConfig) -> list[str]:
    """The roles whose workers run with prefix caching off."""
    roles = {"prefill": config.prefill_args, "decode": config.decode_args}
    return [r for r, extra in roles.items() if prefix_caching_off((*config.worker_args, *extra))]


def pool_note(config: LauncherConfig, model_dir: str | Path) -> str:
    """One line when pdserve's pool is asked for a hybrid model whose workers will not use it ("" otherwise)."""
    if not (config.pool and config.pool_backend == "pdserve" and config.connector and config.kv_connector == "pdserve"):
        return ""
    cfg = model_config(model_dir)
    groups = "; ".join(g for g in (window_layers(cfg), state_layers(cfg)) if g)
    off = _off_roles(config)
    if not groups or not off:
        return ""
    return (f"kv pool: not used by the {' and '.join(off)} workers: their vLLM arguments turn prefix caching off "
            f"(--no-enable-prefix-caching), and a worker never computes on top of KV its engine would not reuse "
            f"(the KV cache is hybrid: {groups}); P -> D hand-offs move every KV cache group without it "
            "(--no-pool skips starting the pool's processes)")


def check_pool_model(config: LauncherConfig, model_dir: str | Path) -> None:
    """Refuse Mooncake Store as the pool for a Mamba / linear-attention model whose workers run with prefix caching
    off (the module docstring says why)."""
    if not (config.pool and config.pool_backend == "mooncake" and config.connector):
        return
    found = state_layers(model_config(model_dir))
    off = _off_roles(config)
    if not found or not off:
        return
    raise ConfigError(
        f"--pool-backend mooncake with {Path(model_dir).name}: the model has Mamba / linear-attention layers "
        f"({found}) and the {' and '.join(off)} workers run with --no-enable-prefix-caching, which leaves vLLM's "
        "mamba_cache_mode at 'none'; vLLM 0.32's MooncakeStoreConnector takes a Mamba KV cache group only in "
        "mamba_cache_mode 'align' (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/connector.py, "
        "_validate_kv_cache_config) and every worker would die at start. Drop --no-enable-prefix-caching where the "
        "model's kernels support prefix caching, or serve without the pool (--no-pool)")
