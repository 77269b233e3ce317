"""What vLLM's own data planes cannot serve exactly, refused before anything starts (``pdserve serve``, ``--dry-run``).

vLLM 0.32's NixlConnector and MooncakeConnector hand a model with Mamba or linear-attention layers (a state that
grows token by token: gated delta-net, Mamba2) off one token short: P computes the prompt less its last token, D
loads that state, h(N-1), and computes the last prompt token itself (``_prefill_backoff`` /
``_truncate_request_for_prefill`` in vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py:379-435;
``_get_remote_prefill_token_count`` / ``_truncate_mamba_request_for_prefill`` in
.../v1/mooncake/mooncake_connector.py:946-990). One worker computes the prompt in one pass. In half precision that
split changes greedy answers: with the tiny Qwen3-Next (bf16, as vLLM's CPU gated delta-net kernel demands) 2 of 4
prompts answered otherwise than one worker, with HTTP 200, and plain vLLM answers exactly those wrong tokens when
its own chunked prefill ends a prompt on a one-token chunk (``--max-num-batched-tokens N-1``); Granite-4 hybrid
(Mamba2) in bf16 the same, in fp32 neither (docs/architecture.md, "vLLM's NixlConnector"). pdserve's connector
hands off the state after the whole prompt and P's first token, so it stays exact.

MLA on CPU workers (:func:`check_mla_rotary`): vLLM 0.32's CPU rotary kernel (``torch.ops._C.rotary_embedding``,
the path ``--enforce-eager`` takes) rotates MLA's strided query otherwise with 4 heads per rank than with 2, and
caches ``k_pe`` otherwise in a multi-token pass than in a one-token one (docs/architecture.md, "MLA under TP"). So
a hand-off where D computes the last prompt token on P's KV (vLLM's NixlConnector and MooncakeConnector: 0 of 4
greedy answers equal to one worker's on a tiny DeepSeek-V3 in fp32, with HTTP 200), or where P and D run other TP
degrees (pdserve's connector: neither plain worker's answer), answers wrong tokens. With vLLM's PyTorch rotary
(``-cc.custom_ops+=-rotary_embedding``) all of them are exact (4 of 4 on both vLLM planes,
``benchmarks/hybrid_matrix.py --families deepseekv3 --worker-args=-cc.custom_ops+=-rotary_embedding``; the TP 2 -> 1
slow test), so the launch refuses them without it and says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import ConfigError, LauncherConfig, WorkerConfig

ONE_TOKEN_SHORT = ("nixl", "mooncake")  # vLLM's connectors that hand a state model off at h(N-1)
FULL_PRECISION = ("float32", "float", "fp32")
_STATE_TYPES = ("linear_attention", "mamba", "mamba2")  # layer_types entries of a state layer
_STATE_ARCHS = ("Mamba", "Jamba", "Bamba", "Zamba", "NemotronH", "FalconH1", "Lfm2", "Qwen3Next", "MiniMaxText01",
                "Plamo2", "GraniteMoeHybrid")
NATIVE_ROPE = "-cc.custom_ops+=-rotary_embedding"  # vLLM's PyTorch rotary instead of its CPU kernel
WHERE = {"nixl": "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py:379-435 "
                 "(_prefill_backoff, _truncate_request_for_prefill)",
         "mooncake": "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py:946-990 "
                     "(_get_remote_prefill_token_count, _truncate_mamba_request_for_prefill)"}


def model_config(model_dir: str | Path) -> dict[str, Any]:
    """The model folder's config.json ({} when there is none yet, e.g. a model still to be converted)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def state_layers(cfg: dict[str, Any]) -> str:
    """What in a model's config.json names Mamba / linear-attention layers ("" none): ``layer_types``,
    Nemotron-H's ``hybrid_override_pattern``, or an architecture made of them."""
    text = cfg.get("text_config")
    if isinstance(text, dict):
        found = state_layers(text)
        if found:
            return found
    types = cfg.get("layer_types")
    if isinstance(types, list):
        kinds = sorted({t for t in types if t in _STATE_TYPES})
        if kinds:
            return f"{sum(t in kinds for t in types)} of {len(types)} layers in layer_types are {kinds}"
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and "M" in pattern:
        return f"{pattern.count('M')} Mamba layers in hybrid_override_pattern"
    for arch in cfg.get("architectures") or ():
        if any(str(arch).startswith(name) for name in _STATE_ARCHS):
            return f"architecture {arch}"
    return ""


def worker_dtype(worker: WorkerConfig) -> str | None:
    """The ``--dtype`` vLLM will use: the last one in the worker's extra arguments (``--worker-args``, which follow
    the launcher's own), else the launcher's (None: vLLM's auto)."""
    dtype = worker.dtype
    args = list(worker.extra_args)
    for i, arg in enumerate(args):
        if arg == "--dtype" and i + 1 < len(args):
            dtype = args[i + 1]
        elif arg.startswith("--dtype="):
            dtype = arg.split("=", 1)[1]
    return dtype


def half_precision(worker: WorkerConfig) -> bool:
    """Whether the worker computes in half precision: its ``--dtype``, or, without one (GPU workers), vLLM's
    ``auto``, which downcasts even a float32 checkpoint (vllm/config/model.py:2422-2424)."""
    dtype = worker_dtype(worker)
    return dtype is None or dtype.lower() not in FULL_PRECISION  # "auto" too: vLLM downcasts a float32 checkpoint


def check_plane(config: LauncherConfig, workers: Sequence[WorkerConfig], model_dir: str | Path) -> None:
    """Refuse a P -> D launch on vLLM's NixlConnector or MooncakeConnector that would answer wrong tokens: a model
    with Mamba / linear-attention layers on half-precision workers (the module docstring says why)."""
    plane = config.kv_connector
    if plane not in ONE_TOKEN_SHORT or config.mode != "disaggregated" or not config.connector:
        return
    found = state_layers(model_config(model_dir))
    half = [w for w in workers if half_precision(w)]
    if not found or not half:
        return
    dtype = worker_dtype(half[0]) or "vLLM's auto dtype (half precision on GPUs)"
    raise ConfigError(
        f"--kv-connector {plane} with {Path(model_dir).name} in {dtype}: the model has Mamba / linear-attention "
        f"layers ({found}), and vLLM 0.32's {'NixlConnector' if plane == 'nixl' else 'MooncakeConnector'} hands "
        f"such a model off one token short (P computes the prompt less its last token, D continues the state from "
        f"there: {WHERE[plane]}); in half precision that split answers otherwise than one worker (wrong tokens with "
        "HTTP 200). Use pdserve's connector (--kv-connector pdserve, the default), which hands off the state after "
        "the whole prompt, or --dtype float32 where the model's kernels run in it (vLLM's CPU gated delta-net "
        "kernel, Qwen3-Next, does not)")


def is_mla(cfg: dict[str, Any]) -> bool:
    """Whether a model's config.json describes multi-head latent attention (DeepSeek-V2/V3's ``kv_lora_rank``)."""
    text = cfg.get("text_config")
    return bool(cfg.get("kv_lora_rank")) or (isinstance(text, dict) and bool(text.get("kv_lora_rank")))


def native_rope(worker: WorkerConfig) -> bool:
    """Whether the worker's extra arguments turn vLLM's CPU rotary kernel off (``-cc.custom_ops+=-rotary_embedding``,
    or the same in a ``--compilation-config`` / ``-cc`` JSON's ``custom_ops``: either way an argument names
    ``-rotary_embedding``)."""
    return any("-rotary_embedding" in arg for arg in worker.extra_args)


def check_mla_rotary(config: LauncherConfig, workers: Sequence[WorkerConfig], model_dir: str | Path) -> None:
    """Refuse a P -> D launch of an MLA model on CPU workers that would answer wrong tokens with vLLM's CPU rotary
    kernel (the module docstring): on vLLM's NixlConnector or MooncakeConnector, or with P and D at other TP
    degrees, unless every worker runs vLLM's PyTorch rotary."""
    if config.mode != "disaggregated" or not config.connector or not is_mla(model_config(model_dir)):
        return
    cpu = [w for w in workers if not w.gpus]
    if not cpu or all(native_rope(w) for w in cpu):
        return
    tps = {w.tp for w in workers if w.role in ("prefill", "decode")}
    if config.kv_connector in ONE_TOKEN_SHORT:
        why = (f"vLLM's {'NixlConnector' if config.kv_connector == 'nixl' else 'MooncakeConnector'} has D compute "
               "the last prompt token on P's KV, which vLLM 0.32's CPU rotary kernel caches otherwise than one "
               "worker's single pass (0 of 4 greedy answers equal, with HTTP 200)")
    elif len(tps) > 1:
        why = (f"P and D run other tensor-parallel degrees ({sorted(tps)}), and vLLM 0.32's CPU rotary kernel rotates "
               "MLA's query otherwise per heads on a rank, so neither plain worker's answer comes back")
    else:
        return
    raise ConfigError(
        f"{Path(model_dir).name} is an MLA model on CPU workers: {why} (docs/architecture.md, \"MLA under TP\"). "
        f"Add vLLM's PyTorch rotary to every worker, --worker-args '{NATIVE_ROPE}' (exact on every plane), or use "
        "pdserve's connector (--kv-connector pdserve) with the same TP on P and D")
