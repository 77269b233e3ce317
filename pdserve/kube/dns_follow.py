"""DNS discovery's rules (:mod:`.discovery`) applied to an in-process membership instead of a router's HTTP API:
every ``interval_s`` each pool's headless Service name is resolved (off the event loop) and
:class:`~.discovery.Reconciler` adds the new addresses and removes those gone for ``absent_rounds`` rounds.

The endpoint picker follows the workers into its own registry this way, and the KV indexer into its event feed
(neither has the membership API the discovery sidecar calls)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .discovery import DiscoveryConfig, PoolTarget, Reconciler, RouterApi, resolve_addresses

log = logging.getLogger("pdserve.kube.dns_follow")


def pools(prefill_dns: str, decode_dns: str) -> tuple[PoolTarget, ...]:
    """The pools to follow (DiscoveryConfigError, with the fix, for a spec that is not NAME:PORT)."""
    return tuple(PoolTarget.parse(role, spec) for role, spec in (("prefill", prefill_dns), ("decode", decode_dns))
                 if spec)


async def follow_dns(membership: RouterApi, targets: tuple[PoolTarget, ...], interval_s: float,
                     resolver: Callable[[str, int], set[str] | None] = resolve_addresses) -> None:
    """Reconcile ``membership`` with the pools' DNS every ``interval_s`` until cancelled."""
    found: dict[tuple[str, int], set[str] | None] = {}
    # the config's router URL names the membership being reconciled; here it is this process's own
    config = DiscoveryConfig(router="http://127.0.0.1", pools=targets, interval_s=interval_s)
    reconciler = Reconciler(config, membership, resolver=lambda h, p: found.get((h, p)))
    while True:
        for t in targets:
            found[(t.host, t.port)] = await asyncio.to_thread(resolver, t.host, t.port)
        res = reconciler.step()
        if res.unresolved:
            log.warning("DNS of the %s pool did not resolve; its workers stay as they were", "/".join(res.unresolved))
        await asyncio.sleep(interval_s)
