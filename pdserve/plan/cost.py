"""Hardware-derived cost model: the conductor's ``CostModel`` protocol from a model spec, a device and a link.

- prefill: (2 x active params x new tokens + attention FLOPs over cached + new) / (devices x peak x MFU),
  never faster than reading the weights and the cached prefix's KV once.
- decode step: (weights read + KV bytes of the batch) / (devices x bandwidth x MBU), never faster than its
  FLOPs; MoE reads only the experts the batch touches (E x (1 - (1 - k/E)^batch) of them).
- transfer: bytes / (link rate x efficiency x the instance's share of the NICs) + a per-batch overhead.
- ``tp``: tensor-parallel degree (dense weights and KV split over it); ``ep``: expert-parallel degree
  (routed experts split over it). An instance has max(tp, ep) devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Accelerator, Link
from .kvsize import ModelSpec, dtype_bytes


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    ep: int = 1
    efficiency: float = 0.9  # fraction of linear scaling kept when an instance spans several devices

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1:
            raise ValueError(f"tp and ep must be >= 1, got tp={self.tp} ep={self.ep}")

    @property
    def devices(self) -> int:
        return max(self.tp, self.ep)

    @property
    def scale(self) -> float:
        return 1.0 if self.devices == 1 else self.devices * self.efficiency


class HardwareCostModel:
    """Seconds for prefill, decode steps and KV transfers of one serving instance (implements CostModel)."""

    def __init__(self, model: ModelSpec, acc: Accelerator, link: Link, parallel: Parallelism = Parallelism(),
                 kv_dtype: str = "bf16", handoff_s: float = 0.005, memory_utilization: float = 0.9) -> None:
        self.model, self.acc, self.link, self.parallel = model, acc, link, parallel
        self.kv_dtype = kv_dtype
        self.handoff_s = handoff_s
        self.memory_utilization = memory_utilization
        self.kv_bytes_per_token = int(model.kv_bytes_per_token_long(kv_dtype) or model.kv_bytes_per_token(kv_dtype))
        self._window_bytes = model.kv_bytes(1 << 30, kv_dtype) - self.kv_bytes_per_token * (1 << 30)
        wb = dtype_bytes(model.weight_dtype)
        self._expert_bytes = model.expert_params * wb
        self._dense_bytes = (model.total_params - model.expert_params) * wb
        self._flops = acc.peak_flops(model.weight_dtype) * acc.mfu * parallel.scale
        self._bw = acc.mem_bw * acc.mbu * parallel.scale

    # ---- capacity ----
    def weight_bytes_per_device(self) -> float:
        p = self.parallel
        return self._dense_bytes / p.tp + self._expert_bytes / p.devices

    def fits(self) -> bool:
        """Weights leave room for KV (at least 10% of usable memory) on every device."""
        usable = self.acc.memory_bytes * self.memory_utilization
        return self.weight_bytes_per_device() < 0.9 * usable

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV an instance holds once its weights are loaded (0 when they do not fit)."""
        free = (self.acc.memory_bytes * self.memory_utilization - self.weight_bytes_per_device())
        return max(0, int(free * self.parallel.devices / self.kv_bytes_per_token))

    # ---- CostModel protocol ----
    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        m = self.model
        flops = 2.0 * m.active_params * new_tokens + m.attention_flops(new_tokens, cached_tokens)
        read = (self.weight_bytes_per_device() * self.parallel.devices + self.kv_bytes(cached_tokens)) / self._bw
        return max(flops / self._flops, read) + self.acc.step_overhead_s

    def _weights_read(self, batch: int) -> float:
        m = self.model
        if not m.is_moe:
            return self._dense_bytes
        touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** batch
        return self._dense_bytes + self._expert_bytes * touched

    def decode_step_s(self, batch: int, total_context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        kv = total_context_tokens * self.kv_bytes_per_token + batch * self._window_bytes
        mem = (self._weights_read(batch) + kv) / self._bw
        avg = total_context_tokens / batch
        flops = 2.0 * self.model.active_params * batch + batch * self.model.attention_flops(1, int(avg))
        return max(mem, flops / self._flops) + self.acc.step_overhead_s

    def transfer_s(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return nbytes / self.link.effective_bytes_s(self.parallel.devices) + self.link.overhead_s

    def kv_bytes(self, context_tokens: int) -> float:
        """Exact KV bytes of one request (window layers capped at their window)."""
        return self.model.kv_bytes(context_tokens, self.kv_dtype)


def min_parallel(model: ModelSpec, acc: Accelerator, link: Link, kv_dtype: str = "bf16",
                 max_devices: int = 64) -> Parallelism:
    """Smallest power-of-two instance (TP for dense, EP=TP for MoE) whose weights fit with room for KV."""
    d = 1
    while d <= max_devices:
        par = Parallelism(tp=d, ep=d if model.is_moe else 1)
        if HardwareCostModel(model, acc, link, par, kv_dtype).fits():
            return par
        d *= 2
    raise ValueError(f"{model.name} does not fit on {max_devices} x {acc.name}")
