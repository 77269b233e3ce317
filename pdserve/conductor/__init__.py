"""The conductor: KV-cache-aware, load-aware placement (Mooncake FAST'25 Algorithm 1 and what came after).

Pure Python: no vLLM, no HTTP. The router feeds it worker membership, KV events and request lifecycle; the
simulator in :mod:`pdserve.plan` drives the same code with simulated workers.

- :mod:`.index`      prefix index: block key -> holders (workers, pool tiers); longest prefix per holder
- :mod:`.load`       per-worker load view: queued prefills, running decodes, KV room, reported metrics
- :mod:`.cost_model` prefill / decode-step / transfer / hand-off time, fitted online from observations
- :mod:`.events`     vLLM KV events (BlockStored / BlockRemoved / AllBlocksCleared) -> index updates
- :mod:`.decision`   what is placed and decided (PlacementRequest, Decision, Candidate, PrefillOption, Placed)
- :mod:`.view`       FleetView: the load view, index and cost model, and the predictions every rule shares
- :mod:`.policy`     the decision: (P, D), decode-local, or reject with Retry-After; Conductor is a FleetView
- :mod:`.elastic`    elastic workers: colocated, chunked or split per request
- :mod:`.moves`      moving running decodes off a worker that starts a long prefill
"""

from .config import POLICIES, ConductorConfig, ConductorConfigError
from .cost_model import CostModel, OnlineCostModel
from .index import PrefixIndex
from .policy import Conductor, Decision, PlacementRequest
from .view import FleetView

__all__ = ["POLICIES", "Conductor", "ConductorConfig", "ConductorConfigError", "CostModel", "Decision",
           "FleetView", "OnlineCostModel", "PlacementRequest", "PrefixIndex"]
