"""What loading cached KV from each tier costs: a bandwidth per tier, learned from the placements that loaded.

A prefill worker can start from blocks it does not hold on its device: its own host or disk offload (vLLM's
offload connectors load them), the KV pool's memory or disk (pdserve's connector) or a remote store (vLLM's
MooncakeStoreConnector). Loading ``n`` bytes from tier t costs ``overhead_s + n / bandwidth[t]``; the pool's
memory keeps the cost model's own transfer bandwidth (:meth:`~.cost_model.OnlineCostModel.transfer_s`, learned
from the transfers it observes), the other tiers start from priors and learn from the placements that loaded
from them (:meth:`TierCosts.observe`: the part of a prefill's measured time beyond the predicted compute).
"""

from __future__ import annotations

from collections.abc import Callable

from .tiers import DISK, HOST, POOL_DISK, POOL_MEMORY, STORE

# bytes/s before any observation: host memcpy or PCIe, a local NVMe, a pool node's SSD over the network, a
# remote store over the network
PRIORS: dict[str, float] = {HOST: 8.0e9, DISK: 2.0e9, POOL_DISK: 1.0e9, STORE: 2.0e9}


class TierCosts:
    def __init__(self, transfer_s: Callable[[int], float], overhead_s: float = 0.002,
                 priors: dict[str, float] | None = None) -> None:
        self.transfer_s = transfer_s
        self.overhead_s = overhead_s
        self.bandwidth: dict[str, float] = dict(priors or PRIORS)
        self.observations: dict[str, int] = {}

    def load_s(self, tier: str, nbytes: int) -> float:
        """Predicted seconds to load ``nbytes`` of KV from ``tier`` into a prefill worker."""
        if nbytes <= 0:
            return 0.0
        bw = self.bandwidth.get(tier)
        if tier == POOL_MEMORY or bw is None:
            return self.transfer_s(nbytes)
        return self.overhead_s + nbytes / bw

    def observe(self, tier: str, nbytes: int, seconds: float, alpha: float = 0.2) -> None:
        """A placement loaded ``nbytes`` from ``tier`` and took ``seconds`` beyond its predicted compute."""
        if tier == POOL_MEMORY or tier not in self.bandwidth or nbytes <= 0 or seconds <= self.overhead_s:
            return
        bw = nbytes / (seconds - self.overhead_s)
        self.bandwidth[tier] = (1 - alpha) * self.bandwidth[tier] + alpha * bw
        self.observations[tier] = self.observations.get(tier, 0) + 1

    def describe(self) -> dict:
        return {"bandwidth_bytes_s": dict(self.bandwidth), "observations": dict(self.observations)}
