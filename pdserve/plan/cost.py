"""Hardware-derived cost model: the conductor's ``CostModel`` protocol from a model spec, a device and a link.

- prefill: (2 x active params x new tokens + attention FLOPs over cached + new) / (devices x peak x MFU),
  never faster than reading the weights and the cached prefix's KV once.
- decode step: (weights read + KV bytes of the batch) / (devices x bandwidth x MBU), never faster than its
  FLOPs; MoE reads only the experts the batch touches (E x (1 - (1 - k/E)^batch) of them).
- transfer: bytes / (link rate x efficiency x the instance's share of the NICs) + a per-batch overhead.
- ``tp``: tensor-parallel degree (dense weights and KV heads split over it); ``dp``: data-parallel attention
  ranks (each a TP group of its own, with its own requests and KV: vLLM's --data-parallel-size); ``ep``:
  expert-parallel degree (routed experts split over it; vLLM's --enable-expert-parallel makes it tp x dp). An
  instance has max(tp x dp, ep) devices. MLA's latent is one KV head, which every TP rank holds whole: TP adds
  no KV room for it, DP does (a wide-EP decode pool: dp = ep = devices, tp = 1).
- transfer fan-out (``decode_parallel`` with another TP than P's, :class:`Fanout`): every D rank reads its
  heads' slices from the P ranks holding them, all rank pairs at once; the time is set by the busiest rank
  (the side with fewer ranks moves more bytes each, over one device's share of the NICs) plus one per-batch
  overhead per P rank a D rank reads from.
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
    dp: int = 1  # data-parallel attention ranks (TP groups) of one instance

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1 or self.dp < 1:
            raise ValueError(f"tp, dp and ep must be >= 1, got tp={self.tp} dp={self.dp} ep={self.ep}")

    @property
    def devices(self) -> int:
        return max(self.tp * self.dp, self.ep)

    @classmethod
    def of(cls, tp: int, dp: int, moe: bool, ep: int | None = None) -> Parallelism:
        """TP x DP ranks; a MoE model's experts over all of them unless ``ep`` says otherwise."""
        return cls(tp=tp, dp=dp, ep=ep if ep else (tp * dp if moe else 1))

    @property
    def scale(self) -> float:
        return 1.0 if self.devices == 1 else self.devices * self.efficiency


class HardwareCostModel:
    """Seconds for prefill, decode steps and KV transfers of one serving instance (implements CostModel)."""

    def __init__(self, model: ModelSpec, acc: Accelerator, link: Link, parallel: Parallelism = Parallelism(),
                 kv_dtype: str = "bf16", handoff_s: float = 0.005, memory_utilization: float = 0.9,
                 decode_parallel: Parallelism | None = None) -> None:
        self.model, self.acc, self.link, self.parallel = model, acc, link, parallel
        self.decode_parallel = decode_parallel  # D's, when it differs from P's (transfer fan-out only)
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

    @property
    def layers(self) -> int:
        """Attention layers holding KV: a layer-wise transfer moves this many batches per request."""
        return max(1, sum(g.layers for g in self.model.groups))

    # ---- capacity ----
    def weight_bytes_per_device(self) -> float:
        p = self.parallel
        return self._dense_bytes / p.tp + self._expert_bytes / p.ep

    def fits(self) -> bool:
        """Weights leave room for KV (at least 10% of usable memory) on every device."""
        usable = self.acc.memory_bytes * self.memory_utilization
        return self.weight_bytes_per_device() < 0.9 * usable

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV an instance holds once its weights are loaded (0 when they do not fit)."""
        free = (self.acc.memory_bytes * self.memory_utilization - self.weight_bytes_per_device())
        return max(0, int(free * self.kv_shards() / self.kv_bytes_per_token))

    def kv_shards(self) -> int:
        """Devices whose KV memory adds up: each DP rank holds its own requests; TP splits KV heads, except
        MLA's one latent, which every TP rank holds whole."""
        p = self.parallel
        latent = bool(self.model.groups) and all(g.kind == "mla" for g in self.model.groups)
        return p.dp * (1 if latent else p.tp)

    # ---- CostModel protocol ----
    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        m = self.model
        flops = 2.0 * m.active_params * new_tokens + m.attention_flops(new_tokens, cached_tokens)
        # one request runs on one DP rank: its TP group's share of the instance
        share = 1.0 / self.parallel.dp
        read = (self._dense_bytes + self._expert_bytes + self.kv_bytes(cached_tokens)) / (self._bw * share)
        return max(flops / (self._flops * share), read) + self.acc.step_overhead_s

    def _weights_read(self, batch: int) -> float:
        m = self.model
        if not m.is_moe:
            return self._dense_bytes * self.parallel.dp
        touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** batch
        return self._dense_bytes * self.parallel.dp + self._expert_bytes * touched  # each DP rank reads dense

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
        fan = self.fanout()
        if fan is not None and fan.p_tp != fan.d_tp:
            return fan.transfer_s(nbytes, self.link)
        return nbytes / self.link.effective_bytes_s(self.parallel.devices) + self.link.overhead_s

    def fanout(self) -> Fanout | None:
        """P -> D rank fan-out when D's parallelism was given (None: D is like P)."""
        if self.decode_parallel is None:
            return None
        heads = max((g.kv_heads for g in self.model.groups), default=1)
        return Fanout(self.parallel.tp, self.decode_parallel.tp, heads)

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


@dataclass(frozen=True)
class Fanout:
    """How a request's KV moves from a P instance of ``p_tp`` ranks to a D instance of ``d_tp`` ranks when the
    model has ``kv_heads`` KV heads (vLLM shards heads over TP ranks and replicates them when tp > heads)."""

    p_tp: int
    d_tp: int
    kv_heads: int

    def __post_init__(self) -> None:
        for name, tp in (("P", self.p_tp), ("D", self.d_tp)):
            if tp < 1 or (self.kv_heads % tp and tp % self.kv_heads):
                raise ValueError(f"{name} tp={tp} cannot shard {self.kv_heads} KV heads (neither divides the other)")

    @property
    def p_ranks_per_d_rank(self) -> int:
        """P ranks each D rank reads from (one batch each)."""
        return max(1, min(self.p_tp, self.kv_heads) // min(self.d_tp, self.kv_heads))

    @property
    def d_ranks_per_p_rank(self) -> int:
        """D ranks reading each P rank that is read (its notifications P waits for)."""
        return max(1, min(self.d_tp, self.kv_heads) // min(self.p_tp, self.kv_heads))

    @property
    def flows(self) -> int:
        """Rank-to-rank batches per request."""
        return self.d_tp * self.p_ranks_per_d_rank

    @property
    def strided(self) -> bool:
        """D's ranks read head slices of P's blocks (different TP) rather than whole blocks."""
        return self.p_tp != self.d_tp

    def moved_bytes(self, nbytes: float) -> float:
        """Bytes on the wire for a request of ``nbytes`` of KV: D ranks that replicate a head each read it."""
        return nbytes * self.d_tp / min(self.d_tp, self.kv_heads)

    def busiest_rank_bytes(self, nbytes: float) -> float:
        per_d = nbytes / min(self.d_tp, self.kv_heads)
        per_p = self.moved_bytes(nbytes) / min(self.p_tp, self.kv_heads)
        return max(per_d, per_p)

    def transfer_s(self, nbytes: float, link: Link) -> float:
        if nbytes <= 0:
            return 0.0
        return (self.busiest_rank_bytes(nbytes) / link.effective_bytes_s(1)
                + link.overhead_s * self.p_ranks_per_d_rank)

    def report(self, nbytes: float, link: Link) -> dict[str, float | int | bool]:
        return {"p_tp": self.p_tp, "d_tp": self.d_tp, "kv_heads": self.kv_heads, "flows": self.flows,
                "p_ranks_per_d_rank": self.p_ranks_per_d_rank, "d_ranks_per_p_rank": self.d_ranks_per_p_rank,
                "strided": self.strided, "moved_bytes": self.moved_bytes(nbytes),
                "busiest_rank_bytes": self.busiest_rank_bytes(nbytes), "transfer_s": self.transfer_s(nbytes, link)}
