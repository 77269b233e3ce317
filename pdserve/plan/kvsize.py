"""KV cache size from a Hugging Face ``config.json`` (or a named preset).

Attention layers are grouped by shape. A group keeps, per layer and per token, ``kv_heads x (k_dim + v_dim)``
elements, for at most ``window`` tokens (sliding-window layers) or for the whole context (full layers):

- MHA/GQA: one group, ``num_key_value_heads x (head_dim + head_dim)``.
- MLA (DeepSeek): one latent shared by all heads: ``kv_lora_rank + qk_rope_head_dim`` elements, no V.
- Hybrid sliding-window + full (MiMo-V2-Flash ``hybrid_layer_pattern``, Gemma/gpt-oss ``layer_types``,
  Mistral ``sliding_window``): window layers keep only the last ``window`` tokens.
- Linear attention (Qwen3-Next gated delta-net, ``layer_types`` ``linear_attention``) and Mamba2 (Granite-4 hybrid
  ``mamba``, Nemotron-H ``M`` in ``hybrid_override_pattern``): a constant state per layer and sequence (a conv state
  and a recurrent state), whatever the context length.
- MoE changes the weights read per decode step, not the KV cache.

:func:`handoff_bytes` is what a P -> D hand-off of a prompt moves under vLLM's hybrid KV cache manager, block by
block as vLLM pages it (benchmarks/hybrid_matrix.py measures it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..settings.errors import ConfigError

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
                                 "fp8": 1, "float8": 1, "int8": 1, "fp4": 0.5, "int4": 0.5}


class ModelConfigError(ConfigError):
    """A config.json (or preset) this calculator cannot read, with what to fix."""


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` (bf16 -> 2, fp8 -> 1)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ModelConfigError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class AttentionGroup:
    """Attention layers of one shape. ``k_dim``/``v_dim`` are cached elements per KV head."""

    kind: str  # "full", "sliding", "mla", or a constant state: "linear" (gated delta-net) / "mamba" (Mamba2)
    layers: int
    kv_heads: int
    k_dim: int
    v_dim: int
    window: int | None  # tokens kept per sequence; None = the whole context
    q_heads: int  # for attention FLOPs
    attn_qk_dim: int  # per query head, for attention FLOPs (MLA: nope + rope)
    attn_v_dim: int
    conv_elems: int = 0  # state layers: conv state elements per layer (cached in the model dtype)
    ssm_elems: int = 0  # recurrent state elements per layer (fp32 for gated delta-net, else the model dtype)

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS

    def state_bytes(self, dtype: str) -> float:
        """Bytes of one layer's state (0 for attention groups)."""
        ssm = 4.0 if self.kind == "linear" else dtype_bytes(dtype)
        return self.conv_elems * dtype_bytes(dtype) + self.ssm_elems * ssm

    def bytes_per_token(self, dtype: str) -> float:
        """Bytes one cached token takes in this group (all its layers)."""
        return self.layers * self.kv_heads * (self.k_dim + self.v_dim) * dtype_bytes(dtype)

    def kept_tokens(self, context: int) -> int:
        return context if self.window is None else min(context, self.window)


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model: attention groups and parameter counts."""

    name: str
    groups: tuple[AttentionGroup, ...]
    total_params: int
    active_params: int  # per token (MoE: shared + routed top-k experts)
    expert_params: int  # all routed-expert weights (0 for dense models)
    num_experts: int
    experts_per_token: int
    moe_layers: int
    weight_dtype: str = "bf16"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def kv_bytes_per_token(self, dtype: str = "bf16") -> float:
        """Bytes per token while the context is shorter than every window (all layers count)."""
        return sum(g.bytes_per_token(dtype) for g in self.groups)

    def kv_bytes_per_token_long(self, dtype: str = "bf16") -> float:
        """Marginal bytes per extra token of a long context (only full-context layers grow)."""
        return sum(g.bytes_per_token(dtype) for g in self.groups if g.window is None and not g.is_state)

    def kv_bytes(self, context: int, dtype: str = "bf16") -> float:
        """Bytes of KV cache one request holds at ``context`` tokens."""
        if context < 0:
            raise ValueError(f"context must be >= 0, got {context}")
        return sum(g.bytes_per_token(dtype) * g.kept_tokens(context) + g.layers * g.state_bytes(dtype)
                   for g in self.groups)

    def kv_bytes_batch(self, contexts: Iterable[int], dtype: str = "bf16") -> float:
        """Bytes of KV cache a decode batch of requests at these context lengths holds."""
        return sum(self.kv_bytes(c, dtype) for c in contexts)

    def weight_bytes(self) -> float:
        return self.total_params * dtype_bytes(self.weight_dtype)

    def attention_flops(self, new_tokens: int, cached_tokens: int) -> float:
        """FLOPs of QK^T and PV for ``new_tokens`` queries after ``cached_tokens`` (causal, windows honoured)."""
        total = 0.0
        for g in self.groups:
            attended = _attended_pairs(new_tokens, cached_tokens, g.window)
            total += 2.0 * g.layers * g.q_heads * (g.attn_qk_dim + g.attn_v_dim) * attended
        return total


def _attended_pairs(n: int, c: int, window: int | None) -> float:
    """Sum over the n new query positions of how many keys each attends to (itself included)."""
    if n <= 0:
        return 0.0
    full = n * c + n * (n + 1) / 2.0
    if window is None:
        return full
    # position p (0-based over the whole sequence) attends to min(p + 1, window) keys
    def s(m: int) -> float:  # sum_{p<m} min(p+1, w)
        w = window
        if m <= w:
            return m * (m + 1) / 2.0
        return w * (w + 1) / 2.0 + (m - w) * w
    return s(c + n) - s(c)


# ---------------------------------------------------------------------------------------------- parsing


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    inner = cfg.get("text_config") or cfg.get("llm_config") or cfg.get("language_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def _need(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ModelConfigError(f"config has no {key!r}; is this a decoder-only LLM config.json?")
    return cfg[key]


STATE_KINDS = ("linear", "mamba")
_LINEAR_TYPES = ("linear_attention",)
_MAMBA_TYPES = ("mamba", "mamba2")


def _layer_kinds(cfg: dict[str, Any], layers: int) -> list[str]:
    """Per layer: "attention", "linear" or "mamba" (``layer_types``, Nemotron-H's ``hybrid_override_pattern``)."""
    pattern = cfg.get("hybrid_override_pattern")  # Nemotron-H: M = Mamba2, * = attention, - / E = MLP / MoE only
    if isinstance(pattern, str) and len(pattern) == layers:
        return ["mamba" if c == "M" else "attention" if c == "*" else "none" for c in pattern]
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        # transformers writes Granite-4 hybrid's Mamba2 layers as "linear_attention" too: its config has mamba_*
        linear = "mamba" if cfg.get("mamba_n_heads") and not cfg.get("linear_num_key_heads") else "linear"
        return [linear if t in _LINEAR_TYPES else "mamba" if t in _MAMBA_TYPES else "attention" for t in types]
    return ["attention"] * layers


def _state_groups(cfg: dict[str, Any], kinds: list[str]) -> list[AttentionGroup]:
    """The constant-state groups: gated delta-net (Qwen3-Next) and Mamba2 (Granite-4 hybrid, Nemotron-H)."""
    out = []
    if kinds.count("linear"):
        k_heads, v_heads = int(_need(cfg, "linear_num_key_heads")), int(_need(cfg, "linear_num_value_heads"))
        k_dim, v_dim = int(_need(cfg, "linear_key_head_dim")), int(_need(cfg, "linear_value_head_dim"))
        conv = (int(cfg.get("linear_conv_kernel_dim") or 4) - 1) * (2 * k_heads * k_dim + v_heads * v_dim)
        out.append(AttentionGroup("linear", kinds.count("linear"), 0, 0, 0, 0, 0, 0, 0, conv, v_heads * k_dim * v_dim))
    if kinds.count("mamba"):
        hidden = int(_need(cfg, "hidden_size"))
        heads = int(cfg.get("mamba_n_heads") or cfg.get("mamba_num_heads") or _need(cfg, "mamba_n_heads"))
        head_dim = cfg.get("mamba_d_head") or cfg.get("mamba_head_dim")
        inner = int(cfg.get("mamba_expand") or 2) * hidden
        head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
        inner = heads * head_dim
        groups = int(cfg.get("mamba_n_groups") or cfg.get("n_groups") or 1)
        state = int(cfg.get("mamba_d_state") or cfg.get("ssm_state_size") or 128)
        conv = (int(cfg.get("mamba_d_conv") or cfg.get("conv_kernel") or 4) - 1) * (inner + 2 * groups * state)
        out.append(AttentionGroup("mamba", kinds.count("mamba"), 0, 0, 0, 0, 0, 0, 0, conv, heads * head_dim * state))
    return out


def _window_flags(cfg: dict[str, Any], layers: int) -> list[bool]:
    """Per layer: True when it is a sliding-window layer."""
    pattern = cfg.get("hybrid_layer_pattern")  # MiMo: 0 = full, 1 = sliding window
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelConfigError(f"hybrid_layer_pattern has {len(pattern)} entries for {layers} layers")
        return [bool(x) for x in pattern]
    types = cfg.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers:
            raise ModelConfigError(f"layer_types has {len(types)} entries for {layers} layers")
        flags = []
        for t in types:
            if t in _LINEAR_TYPES or t in _MAMBA_TYPES:
                flags.append(False)  # a state layer (_state_groups), not counted here
            elif t in ("full_attention", "global", "attention"):
                flags.append(False)
            elif t in ("sliding_attention", "sliding_window", "local", "chunked_attention"):
                flags.append(True)
            else:
                raise ModelConfigError(
                    f"layer type {t!r} is not supported (full_attention / sliding_attention only); "
                    "linear-attention and SSM layers keep a constant state, not a KV cache")
        return flags
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) is not False:
        return [True] * layers  # Mistral-style: every layer windowed
    return [False] * layers


def _window(cfg: dict[str, Any]) -> int:
    w = cfg.get("sliding_window") or cfg.get("sliding_window_size") or cfg.get("attention_window")
    if not w:
        raise ModelConfigError("config marks sliding-window layers but gives no sliding_window size")
    return int(w)


def attention_groups(cfg: dict[str, Any]) -> tuple[AttentionGroup, ...]:
    """Attention groups of a (text) config: MLA, GQA/MHA, or sliding + full."""
    cfg = _text_config(cfg)
    layers = int(_need(cfg, "num_hidden_layers"))
    q_heads = int(_need(cfg, "num_attention_heads"))
    if cfg.get("kv_lora_rank"):
        rope = int(cfg.get("qk_rope_head_dim", 64))
        nope = int(cfg.get("qk_nope_head_dim", 128))
        latent = int(cfg["kv_lora_rank"]) + rope
        return (AttentionGroup("mla", layers, 1, latent, 0, None, q_heads, nope + rope,
                               int(cfg.get("v_head_dim", nope))),)
    hidden = int(_need(cfg, "hidden_size"))
    head_dim = int(cfg.get("head_dim") or hidden // q_heads)
    v_dim = int(cfg.get("v_head_dim") or head_dim)
    kv_heads = int(cfg.get("num_key_value_heads") or q_heads)
    kinds = _layer_kinds(cfg, layers)
    flags = _window_flags(cfg, layers)
    n_win = sum(flags)
    n_full = kinds.count("attention") - n_win
    groups = []
    if n_full:
        groups.append(AttentionGroup("full", n_full, kv_heads, head_dim, v_dim, None, q_heads,
                                     head_dim, v_dim))
    if n_win:
        s_head = int(cfg.get("swa_head_dim") or head_dim)
        groups.append(AttentionGroup(
            "sliding", n_win, int(cfg.get("swa_num_key_value_heads") or kv_heads), s_head,
            int(cfg.get("swa_v_head_dim") or (v_dim if s_head == head_dim else s_head)), _window(cfg),
            int(cfg.get("swa_num_attention_heads") or q_heads), s_head,
            int(cfg.get("swa_v_head_dim") or v_dim)))
    return tuple(groups + _state_groups(cfg, kinds))


def _moe_layer_count(cfg: dict[str, Any], layers: int) -> int:
    freq = cfg.get("moe_layer_freq")
    if isinstance(freq, list):
        return sum(1 for x in freq if x)
    if "first_k_dense_replace" in cfg:
        return layers - int(cfg["first_k_dense_replace"])
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)


def _attention_params(cfg: dict[str, Any], groups: tuple[AttentionGroup, ...], hidden: int) -> int:
    if groups[0].kind == "mla":
        g = groups[0]
        heads, qk, v = g.q_heads, g.attn_qk_dim, g.attn_v_dim
        rank, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim", 64))
        q_rank = cfg.get("q_lora_rank")
        q = hidden * int(q_rank) + int(q_rank) * heads * qk if q_rank else hidden * heads * qk
        kv = hidden * (rank + rope) + rank * heads * (qk - rope + v)
        return g.layers * (q + kv + heads * v * hidden)
    return sum(g.layers * hidden * (g.q_heads * g.attn_qk_dim + g.kv_heads * (g.k_dim + g.v_dim)
                                    + g.q_heads * g.attn_v_dim) for g in groups)


def estimate_params(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(total, active per token, routed-expert) parameter counts estimated from the config's shapes."""
    cfg = _text_config(cfg)
    groups = attention_groups(cfg)
    layers = int(_need(cfg, "num_hidden_layers"))
    hidden = int(_need(cfg, "hidden_size"))
    vocab = int(_need(cfg, "vocab_size"))
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    attn = _attention_params(cfg, groups, hidden)
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    moe_layers = _moe_layer_count(cfg, layers) if experts else 0
    dense_ffn = (layers - moe_layers) * 3 * hidden * int(_need(cfg, "intermediate_size"))
    total = active = embed + attn + dense_ffn
    routed = 0
    if experts:
        moe_inter = int(cfg.get("moe_intermediate_size") or _need(cfg, "intermediate_size"))
        top_k = int(_need(cfg, "num_experts_per_tok"))
        shared = int(cfg.get("n_shared_experts") or 0)
        shared_inter = int(cfg.get("shared_expert_intermediate_size") or shared * moe_inter)
        per_expert = 3 * hidden * moe_inter
        routed = moe_layers * experts * per_expert
        common = moe_layers * (3 * hidden * shared_inter + hidden * experts)  # shared experts + router
        total += routed + common
        active += moe_layers * top_k * per_expert + common
    return total, active, routed


def spec_from_config(cfg: dict[str, Any], name: str = "model", weight_dtype: str | None = None,
                     total_params: int | None = None, active_params: int | None = None) -> ModelSpec:
    """ModelSpec from a config.json dict; published parameter counts override the shape estimate."""
    text = _text_config(cfg)
    groups = attention_groups(text)
    est_total, est_active, routed = estimate_params(text)
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts") or 0)
    total = int(total_params or est_total)
    active = int(active_params or est_active)
    if total_params and routed:  # keep the expert share consistent with the published total
        routed = int(routed * total / est_total)
    if weight_dtype is None:
        weight_dtype = "fp8" if (text.get("quantization_config") or {}).get("quant_method") == "fp8" else "bf16"
    return ModelSpec(name=name, groups=groups, total_params=total, active_params=active, expert_params=routed,
                     num_experts=experts, experts_per_token=int(text.get("num_experts_per_tok") or 0),
                     moe_layers=_moe_layer_count(text, int(text["num_hidden_layers"])) if experts else 0,
                     weight_dtype=weight_dtype)


# ---------------------------------------------------------------------------------------------- presets

_DATA = Path(__file__).with_name("data")


def load_presets() -> dict[str, dict[str, Any]]:
    """Named model presets from pdserve/plan/data/models.json."""
    return json.loads((_DATA / "models.json").read_text())


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (see ``load_presets``), a config.json path or a model folder holding one."""
    presets = load_presets()
    if name_or_path in presets:
        p = presets[name_or_path]
        return spec_from_config(p["config"], name=name_or_path, weight_dtype=p.get("weight_dtype"),
                                total_params=p.get("total_params"), active_params=p.get("active_params"))
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{name_or_path!r} is neither a preset ({', '.join(sorted(presets))}) "
                               "nor a config.json / model folder")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not JSON ({exc})") from None
    return spec_from_config(cfg, name=path.parent.name or path.stem)


def format_bytes(n: float) -> str:
    """1.5 GiB style (binary units), for tables."""
    if n < 1024:
        return f"{n:.0f} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:.2f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"


# ---------------------------------------------------------------------------------------------- hand-off bytes


def hma_block_size(spec: ModelSpec, dtype: str, block_size: int = 128) -> int:
    """The attention block size vLLM's hybrid KV cache manager picks: ``block_size`` grown by whole multiples
    until one attention layer's page holds a state layer's state (vLLM 0.32 pads every state to that page)."""
    per_token = max((g.bytes_per_token(dtype) / g.layers for g in spec.groups if not g.is_state), default=0.0)
    state = max((g.state_bytes(dtype) for g in spec.groups if g.is_state), default=0.0)
    if not state or not per_token:
        return block_size
    return int(math.ceil(state / (per_token * block_size))) * block_size


def handoff_bytes(spec: ModelSpec, prompt_tokens: int, dtype: str = "bf16", block_size: int = 128) -> float:
    """Bytes a P -> D hand-off of a ``prompt_tokens`` prompt moves with vLLM's hybrid KV cache manager on: whole
    blocks, full-attention layers every block of the prompt, sliding-window layers the blocks the next token's
    window reaches, state layers one page (the state, padded to an attention page) each."""
    if prompt_tokens <= 0:
        return 0.0
    bs = hma_block_size(spec, dtype, block_size)
    per_token = max((g.bytes_per_token(dtype) / g.layers for g in spec.groups if not g.is_state), default=0.0)
    page = per_token * bs
    end = -(-prompt_tokens // bs)
    total = 0.0
    for g in spec.groups:
        if g.is_state:
            total += g.layers * (page or g.state_bytes(dtype))
            continue
        first = max(0, prompt_tokens - g.window + 1) // bs if g.window else 0
        total += (end - first) * bs * g.bytes_per_token(dtype)
    return total
