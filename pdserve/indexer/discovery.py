"""The indexer's workers from DNS (``--prefill-dns`` / ``--decode-dns`` with ``--kv-events-port``), as the chart
runs it: each ready pod of a pool is followed at ``tcp://<its IP>:PORT`` (replay ``PORT + 1``) under its URL
``http://<its IP>:<pool port>`` (the topic the chart's workers publish under), and one gone from DNS for
``absent_rounds`` rounds is unregistered (its entries dropped). The rules are :mod:`pdserve.kube.discovery`'s,
applied by :func:`pdserve.kube.dns_follow.follow_dns`.

With DNS on, the pools' DNS is the membership: a worker resumed from the snapshot counts as a member of every pool
followed (the snapshot does not store roles) and leaves when no pool resolves it any more; one registered through
``POST /register`` that no pool resolves leaves the same way."""

from __future__ import annotations

from typing import Protocol

from ..kube.discovery import RouterApiError
from ..router.fleet.kv_events import Publisher, default_publisher


class Followed(Protocol):
    """The part of :class:`~.service.IndexerService` membership needs."""

    def followed(self) -> list[str]: ...
    def register(self, worker: str, publisher: Publisher) -> None: ...
    def unregister(self, worker: str) -> bool: ...


class FeedMembership:
    """:class:`pdserve.kube.discovery.RouterApi` over the indexer's followed workers."""

    def __init__(self, service: Followed, kv_events_port: int, roles: tuple[str, ...]) -> None:
        self.service = service
        self.port = kv_events_port
        self.all_roles = set(roles)
        self.roles: dict[str, set[str]] = {}

    def list_workers(self) -> dict[str, set[str]]:
        return {u: set(self.roles.get(u) or self.all_roles) for u in self.service.followed()}

    def add_worker(self, url: str, role: str) -> None:
        pub = default_publisher(url, self.port)
        if pub is None:
            raise RouterApiError(f"{url}: no host or KV events port to follow its events at")  # logged, skipped
        self.service.register(url, pub)
        self.roles.setdefault(url, set()).add(role)

    def remove_worker(self, url: str) -> None:
        self.service.unregister(url)
        self.roles.pop(url, None)
