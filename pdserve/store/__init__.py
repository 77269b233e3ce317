"""pdserve.store: a shared, tiered KV cache pool (host memory + SSD) that workers reuse prefixes from.

A master holds metadata only (key -> replicas, leases, last use); store nodes lend a host-memory arena
(registered with a transfer engine) and an SSD directory; clients move bytes straight between their
registered memory and the nodes' arenas. Knows nothing of vLLM. See docs/store.md.
"""

from .client import StoreClient
from .config import ClientConfig, MasterConfig, NodeConfig, StoreConfigError, parse_size
from .rpc import StoreError

__all__ = ["ClientConfig", "MasterConfig", "NodeConfig", "StoreClient", "StoreConfigError", "StoreError",
           "parse_size"]
