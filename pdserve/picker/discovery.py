"""The picker's worker membership from DNS (``--prefill-dns`` / ``--decode-dns``): the rules of
:mod:`pdserve.kube.discovery` (a worker missing from DNS for ``absent_rounds`` rounds leaves, a new address
joins), applied to the picker's own registry instead of a router's membership API (the picker has no HTTP front
for the discovery sidecar to call). DNS is resolved off the event loop; the registry changes on it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..kube.discovery import DiscoveryConfig, PoolTarget, Reconciler, resolve_addresses
from ..router.fleet.registry import WorkerRegistry

log = logging.getLogger("pdserve.picker")


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


def pools(prefill_dns: str, decode_dns: str) -> tuple[PoolTarget, ...]:
    """The pools to follow (DiscoveryConfigError, with the fix, for a spec that is not NAME:PORT)."""
    return tuple(PoolTarget.parse(role, spec) for role, spec in (("prefill", prefill_dns), ("decode", decode_dns))
                 if spec)


async def follow_dns(registry: WorkerRegistry, targets: tuple[PoolTarget, ...], interval_s: float,
                     resolver: Callable[[str, int], set[str] | None] = resolve_addresses) -> None:
    """Reconcile ``registry`` with the pools' DNS every ``interval_s`` until cancelled."""
    found: dict[tuple[str, int], set[str] | None] = {}
    # the config's router URL names the membership being reconciled; here it is this process's own registry
    config = DiscoveryConfig(router="http://127.0.0.1", pools=targets, interval_s=interval_s)
    reconciler = Reconciler(config, RegistryMembership(registry), resolver=lambda h, p: found.get((h, p)))
    while True:
        for t in targets:
            found[(t.host, t.port)] = await asyncio.to_thread(resolver, t.host, t.port)
        res = reconciler.step()
        if res.unresolved:
            log.warning("DNS of the %s pool did not resolve; its workers stay as they were", "/".join(res.unresolved))
        await asyncio.sleep(interval_s)
