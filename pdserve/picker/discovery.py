"""The picker's worker membership from DNS (``--prefill-dns`` / ``--decode-dns``): the rules of
:mod:`pdserve.kube.discovery` (a worker missing from DNS for ``absent_rounds`` rounds leaves, a new address
joins), applied to the picker's own registry by :func:`pdserve.kube.dns_follow.follow_dns` (the picker has no
HTTP membership API for the discovery sidecar to call)."""

from __future__ import annotations

from ..kube.dns_follow import follow_dns, pools
from ..router.fleet.registry import WorkerRegistry

__all__ = ["RegistryMembership", "follow_dns", "pools"]


class RegistryMembership:
    """:class:`pdserve.kube.discovery.RouterApi` over an in-process :class:`WorkerRegistry`."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    def list_workers(self) -> dict[str, set[str]]:
        return {w.url: set(w.roles) for w in self.registry}

    def add_worker(self, url: str, role: str) -> None:
        self.registry.add(url, role)

    def remove_worker(self, url: str) -> None:
        self.registry.remove(url)
