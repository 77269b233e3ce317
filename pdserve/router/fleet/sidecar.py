"""The router as a gateway's decode sidecar (``--prefiller-header``): it runs beside one decode worker (its only
``--decode``), knows the prefill pool (``--prefill URL...`` or the membership API), and takes the P -> D pair a
Gateway API Inference Extension endpoint picker chose (``pdserve picker``, llm-d's): the gateway sends the request
to this router (the InferencePool's target port) with P in ``x-prefiller-host-port``.

- The header names a registered, healthy prefill worker: the request's first placement is that P and the local D
  (:meth:`~.placement.ConductorPlacement.choose_on`; the conductor does not weigh the pair). The run is the
  router's normal P -> D path: hand-off, early dispatch, retries and migration.
- No header (the picker chose D alone), or one naming a host:port that is not a registered prefill worker, or an
  unhealthy one: the whole request on the local D. An unknown host is never dialled (no SSRF): it is counted and
  logged.
- A later round of the same request (a worker failed with it, or never took it) is the router's own placement
  without the failed workers, as for any request.

``pdserve_router_sidecar_pairs_total{outcome}`` counts the first placements: ``pair``, ``no_header``,
``unknown_host``, ``bad_header``, ``unhealthy``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ...hashing import ROOT_KEY
from .placement import ConductorPlacement
from .registry import WorkerRegistry
from .ticket import PlacementTicket

__all__ = ["PREFILLER_HEADER", "Pair", "SidecarPlacement", "host_port", "pair_for"]

PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's P -> D header, set by the endpoint picker
OUTCOMES = ("pair", "no_header", "unknown_host", "bad_header", "unhealthy")

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True)
class Pair:
    """A request's first placement as the gateway chose it: P (None: the whole request on D) and the local D;
    ``outcome``: why (one of :data:`OUTCOMES`)."""

    prefill: str | None
    decode: str
    outcome: str

    @property
    def reason(self) -> str:
        if self.prefill is not None:
            return f"the gateway's picker chose this pair ({PREFILLER_HEADER})"
        return f"whole request on the sidecar's decode worker ({self.outcome.replace('_', ' ')})"


def host_port(value: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[IPv6]:PORT`` too) -> (lower-case host, port); None when it is not one."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or any(c in host for c in "/@?# "):
        return None
    return host.lower(), int(port)


def _url_host_port(url: str) -> tuple[str, int] | None:
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return parts.hostname.lower(), port


def pair_for(headers: Mapping[str, str], registry: WorkerRegistry, decode: str) -> Pair:
    """The first placement ``headers`` ask for, matched against the registry's prefill workers only (a name
    outside the pool is never dialled)."""
    value = headers.get(PREFILLER_HEADER)
    if value is None or not value.strip():
        return Pair(None, decode, "no_header")
    want = host_port(value)
    if want is None:
        log.warning("%s %r is not HOST:PORT: the request runs whole on %s", PREFILLER_HEADER, value[:200], decode)
        return Pair(None, decode, "bad_header")
    for w in registry:
        if "prefill" in w.roles and w.url != decode and _url_host_port(w.url) == want:
            if not w.healthy:
                log.warning("%s names %s, which is not healthy: the request runs whole on %s", PREFILLER_HEADER,
                            w.url, decode)
                return Pair(None, decode, "unhealthy")
            return Pair(w.url, decode, "pair")
    log.warning("%s names %s:%d, not a registered prefill worker: not dialled, the request runs whole on %s",
                PREFILLER_HEADER, want[0], want[1], decode)
    return Pair(None, decode, "unknown_host")


class SidecarPlacement:
    """One request's placement in sidecar mode: its first round on ``pair``, every later round (a worker failed or
    never took it) the router's own placement. Every other attribute is the router's placement's."""

    def __init__(self, inner: ConductorPlacement, pair: Pair) -> None:
        self.inner = inner
        self.pair = pair
        self.registry: WorkerRegistry = inner.registry

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def choose(self, prompt_ids: Sequence[int], exclude: frozenset[str] = frozenset(), request_id: str = "",
               max_tokens: int = 16, domain: int = ROOT_KEY, whole: bool = False) -> PlacementTicket:
        p = self.pair
        if exclude or whole:
            return self.inner.choose(prompt_ids, exclude, request_id, max_tokens, domain, whole)
        return self.inner.choose_on(prompt_ids, p.prefill, p.decode, p.reason, request_id, max_tokens, domain)
