"""Worker discovery: keep the router's prefill/decode membership equal to what DNS says is ready.

    python -m pdserve.kube.discovery --router http://127.0.0.1:8000 \\
        --prefill-dns pd-pdserve-prefill.llm.svc:8000 --decode-dns pd-pdserve-decode.llm.svc:8000 --interval 5

On Kubernetes each pool has a headless Service; its name resolves to the addresses of the pool's *ready*
pods. Every ``interval`` seconds this process resolves each pool's name and reconciles the router through the
router's membership API (``GET/POST/DELETE /v1/pdserve/workers``):

- an address that resolves but is not a member is added at once (``POST {"url", "role"}``);
- a member that stops resolving is removed after ``absent_rounds`` rounds in a row (``DELETE {"url"}``:
  the router stops sending it new requests, in-flight ones finish), so one DNS hiccup removes nobody;
- a resolution that fails for another reason than "no such name" (timeouts, SERVFAIL) changes nothing;
- a member that disappears from the router while still resolving was removed by someone else (the worker's
  own preStop drain, ``pdserve.kube.drain``); it is not added back for ``tombstone_s`` seconds or until its name
  stops resolving, so a draining worker is not resurrected from a stale DNS answer.

An elastic router's one pool (``--elastic-dns``) is followed the same way, its workers added with role
``elastic``. Members of other roles (``colocated``) are left alone. The chart runs this as a sidecar of each router pod.
The router's admin token is read from $PDSERVE_ADMIN_TOKEN.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from ..settings.errors import ConfigError, config_fault
from ..settings.spec import Setting, check_fields, write_resolved

log = logging.getLogger("pdserve.kube.discovery")

WORKERS_PATH = "/v1/pdserve/workers"
ROLES = ("prefill", "decode", "elastic")  # elastic: one pool of workers with no fixed role (router --mode elastic)
TOKEN_ENV = "PDSERVE_ADMIN_TOKEN"  # the router's membership API wants it as a bearer token (or a loopback client)

__all__ = [
    "DiscoveryConfig",
    "DiscoveryConfigError",
    "HttpRouterApi",
    "PoolTarget",
    "Reconciler",
    "RouterApiError",
    "StepResult",
    "main",
    "parse_members",
    "resolve_addresses",
    "worker_url",
]


class DiscoveryConfigError(ConfigError):
    """A discovery setting is wrong; the message says which and how to fix it."""


class RouterApiError(RuntimeError):
    """The router's membership API failed (unreachable, or an unexpected status)."""


@dataclass(frozen=True)
class PoolTarget:
    """One pool to follow: its role and the DNS name:port its ready workers resolve under."""

    role: str
    host: str
    port: int

    @classmethod
    def parse(cls, role: str, spec: str) -> PoolTarget:
        host, sep, port = spec.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DiscoveryConfigError(f"--{role}-dns {spec!r}: give NAME:PORT, e.g. "
                                       f"pd-pdserve-{role}.default.svc:8000 (the pool's headless Service)")
        return cls(role, host.strip("[]"), int(port))


# each value's rule, as the table of settings states one (checked by check_fields, named by its flag)
_SETTINGS = (
    Setting("interval_s", float, 5.0, "", (), minimum=0, above=True, flag="--interval",
            advice="must be > 0 seconds"),
    Setting("absent_rounds", int, 2, "", (), minimum=1, advice="use 1 or more rounds"),
    Setting("tombstone_s", float, 300.0, "", (), minimum=0, flag="--tombstone", advice="must be >= 0 seconds"),
    Setting("timeout_s", float, 3.0, "", (), minimum=0, above=True, flag="--timeout", advice="must be > 0 seconds"),
)


@dataclass(frozen=True)
class DiscoveryConfig:
    """Settings of the discovery process.

    router: the router's base URL (the sidecar uses http://127.0.0.1:PORT).
    pools: the pools to follow (at least one).
    interval_s: seconds between reconciliations.
    absent_rounds: a member is removed once its address is missing from DNS this many rounds in a row.
    tombstone_s: a member removed by someone else is not re-added for this long while it still resolves
        (set it to the workers' terminationGracePeriodSeconds).
    timeout_s: HTTP and DNS time budget of one call.
    """

    router: str
    pools: tuple[PoolTarget, ...]
    interval_s: float = 5.0
    absent_rounds: int = 2
    tombstone_s: float = 300.0
    timeout_s: float = 3.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.router)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise DiscoveryConfigError(f"--router {self.router!r}: give the router's base URL like "
                                       "http://127.0.0.1:8000 (no path)")
        write_resolved(self, {"router": self.router.rstrip("/")})
        if not self.pools:
            raise DiscoveryConfigError("nothing to follow: give --prefill-dns and/or --decode-dns NAME:PORT (or "
                                       "--elastic-dns NAME:PORT for an elastic router)")
        roles = [p.role for p in self.pools]
        if len(set(roles)) != len(roles) or not set(roles) <= set(ROLES):
            raise DiscoveryConfigError(f"pools {roles}: one pool per role, roles among {ROLES}")
        if "elastic" in roles and len(roles) > 1:
            raise DiscoveryConfigError("--elastic-dns with --prefill-dns/--decode-dns: an elastic router's workers "
                                       "have no fixed role; follow its one pool with --elastic-dns alone")
        check_fields(self, _SETTINGS, DiscoveryConfigError, flags=True)


# ------------------------------------------------------------------------------------------- DNS


def worker_url(address: str, port: int, scheme: str = "http") -> str:
    """Base URL of a worker at an IP address (IPv6 in brackets)."""
    try:
        if ipaddress.ip_address(address).version == 6:
            address = f"[{address}]"
    except ValueError:
        pass
    return f"{scheme}://{address}:{port}"


def resolve_addresses(host: str, port: int) -> set[str] | None:
    """Addresses ``host`` resolves to now: an empty set when the name does not exist or has no addresses
    (a headless Service with no ready pod), None when resolution failed for another reason (try again)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        gone = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA", "EAI_ADDRFAMILY") if hasattr(socket, n)}
        if exc.errno in gone:
            return set()
        log.warning("resolving %s failed (%s); keeping the current members this round", host, exc)
        return None
    except OSError as exc:
        log.warning("resolving %s failed (%s); keeping the current members this round", host, exc)
        return None
    return {str(info[4][0]) for info in infos}


# ------------------------------------------------------------------------------------ router API


class RouterApi(Protocol):
    def list_workers(self) -> dict[str, set[str]]: ...
    def add_worker(self, url: str, role: str) -> None: ...
    def remove_worker(self, url: str) -> None: ...


def parse_members(payload: object) -> dict[str, set[str]]:
    """``GET /v1/pdserve/workers`` -> {url: roles}. Accepts ``{"workers": [...]}`` or a bare list of
    ``{"url": U, "role": R}`` / ``{"url": U, "roles": [R, ...]}``."""
    items = payload.get("workers") if isinstance(payload, dict) else payload
    if not isinstance(items, list):
        raise RouterApiError(f"unexpected {WORKERS_PATH} body: {str(payload)[:200]}")
    out: dict[str, set[str]] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("url"), str):
            raise RouterApiError(f"unexpected worker entry in {WORKERS_PATH}: {str(item)[:200]}")
        roles = item.get("roles", item.get("role", ()))
        roles = [roles] if isinstance(roles, str) else list(roles or ())
        out.setdefault(item["url"].rstrip("/"), set()).update(str(r) for r in roles)
    return out


class HttpRouterApi:
    """The router's membership API over HTTP (urllib; one short request per call)."""

    def __init__(self, base_url: str, timeout_s: float = 3.0, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.token = os.environ.get(TOKEN_ENV, "") if token is None else token

    def _call(self, method: str, body: Mapping | None = None, ok_extra: Iterable[int] = ()) -> object:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.base_url + WORKERS_PATH, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code in ok_extra:
                return None
            detail = exc.read()[:300].decode(errors="replace")
            if exc.code in (401, 403):
                raise RouterApiError(f"{method} {self.base_url}{WORKERS_PATH} -> {exc.code}: {detail} (set "
                                     f"${TOKEN_ENV} to the router's admin token)") from None
            if exc.code in (404, 405) and method == "GET":
                raise RouterApiError(f"{self.base_url}{WORKERS_PATH} answers {exc.code}: this router has no "
                                     "membership API (update pdserve on the router image)") from None
            raise RouterApiError(
                f"{method} {self.base_url}{WORKERS_PATH} {body or ''} -> {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise RouterApiError(f"{method} {self.base_url}{WORKERS_PATH}: {exc}") from None
        return json.loads(raw) if raw.strip() else None

    def list_workers(self) -> dict[str, set[str]]:
        return parse_members(self._call("GET"))

    def add_worker(self, url: str, role: str) -> None:
        self._call("POST", {"url": url, "role": role}, ok_extra=(409,))

    def remove_worker(self, url: str) -> None:
        self._call("DELETE", {"url": url}, ok_extra=(404,))


# ------------------------------------------------------------------------------------- reconcile


@dataclass
class StepResult:
    """What one reconciliation did."""

    added: list[tuple[str, str]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    tombstoned: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # roles whose DNS failed this round
    error: str = ""

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


class Reconciler:
    """Reconciles the router's membership with DNS, one :meth:`step` at a time (no threads, no sleeping)."""

    def __init__(self, config: DiscoveryConfig, api: RouterApi,
                 resolver: Callable[[str, int], set[str] | None] = resolve_addresses,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.api = api
        self.resolver = resolver
        self.clock = clock
        self._absent: dict[str, int] = {}
        self._tombstones: dict[str, float] = {}
        self._known: set[str] = set()  # managed members after the previous step
        self._removed_by_us: set[str] = set()

    def step(self) -> StepResult:
        res = StepResult()
        try:
            members = self.api.list_workers()
        except RouterApiError as exc:
            res.error = str(exc)
            return res
        managed = {u: r & set(ROLES) for u, r in members.items() if r & set(ROLES)}
        now = self.clock()

        desired: dict[str, set[str]] = {}
        for pool in self.config.pools:
            addrs = self.resolver(pool.host, pool.port)
            if addrs is None:
                res.unresolved.append(pool.role)
                continue
            desired[pool.role] = {worker_url(a, pool.port) for a in addrs}
        resolving = set().union(*desired.values()) if desired else set()

        # members that vanished without us removing them: someone drained them; do not resurrect them.
        # When every known member vanished at once the router restarted (lost its state): re-add them all.
        vanished = self._known - set(managed) - self._removed_by_us
        if vanished and self._known & set(managed):
            for url in sorted(vanished):
                self._tombstones[url] = now
                res.tombstoned.append(url)
                log.info("%s left the router while still in DNS (drained?): not re-adding it for %.0f s",
                         url, self.config.tombstone_s)
        elif vanished:
            log.warning("the router lost all %d workers it had (restarted?): adding them again", len(vanished))
        self._removed_by_us &= set(managed)
        for url, since in list(self._tombstones.items()):
            expired = now - since >= self.config.tombstone_s
            left_dns = all(role in desired for role in (p.role for p in self.config.pools)) and url not in resolving
            if expired or left_dns:
                del self._tombstones[url]

        for role, urls in desired.items():
            for url in sorted(urls):
                if role in managed.get(url, ()) or url in self._tombstones:
                    continue
                try:
                    self.api.add_worker(url, role)
                except RouterApiError as exc:
                    log.warning("adding %s %s failed: %s", role, url, exc)
                    continue
                managed.setdefault(url, set()).add(role)
                res.added.append((url, role))
                log.info("added %s worker %s", role, url)

        for url, roles in sorted(managed.items()):
            judged = [r for r in roles if r in desired]
            if not judged or any(url in desired[r] for r in judged):
                self._absent.pop(url, None)
                continue
            self._absent[url] = self._absent.get(url, 0) + 1
            if self._absent[url] < self.config.absent_rounds:
                continue
            try:
                self.api.remove_worker(url)
            except RouterApiError as exc:
                log.warning("removing %s failed: %s", url, exc)
                continue
            del self._absent[url]
            self._removed_by_us.add(url)
            res.removed.append(url)
            log.info("removed %s worker %s (gone from DNS for %d rounds)", "/".join(sorted(roles)), url,
                     self.config.absent_rounds)
        self._absent = {u: n for u, n in self._absent.items() if u in managed}
        self._known = set(managed) - set(res.removed)
        return res

    def run(self, stop: threading.Event) -> None:
        """Reconcile every ``interval_s`` until ``stop`` is set; router errors are logged once per streak."""
        failing = False
        while not stop.is_set():
            res = self.step()
            if res.error and not failing:
                log.warning("router membership API unavailable (%s); retrying every %.0f s", res.error,
                            self.config.interval_s)
            elif failing and not res.error:
                log.info("router membership API reachable again")
            failing = bool(res.error)
            stop.wait(self.config.interval_s)


# ------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.kube.discovery",
                                description="Follow the prefill/decode pools in DNS (headless Services) and keep "
                                            "the router's worker membership in step, without restarting it.")
    p.add_argument("--router", required=True, help="router base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--prefill-dns", metavar="NAME:PORT", help="DNS name:port of the prefill pool")
    p.add_argument("--decode-dns", metavar="NAME:PORT", help="DNS name:port of the decode pool")
    p.add_argument("--elastic-dns", metavar="NAME:PORT",
                   help="DNS name:port of the elastic pool (workers with no fixed role; router --mode elastic), "
                        "instead of --prefill-dns/--decode-dns")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between reconciliations (default 5)")
    p.add_argument("--absent-rounds", type=int, default=2,
                   help="remove a worker missing from DNS this many rounds in a row (default 2)")
    p.add_argument("--tombstone", type=float, default=300.0,
                   help="seconds a worker removed by its own drain is not re-added (default 300)")
    p.add_argument("--timeout", type=float, default=3.0, help="HTTP/DNS timeout per call (default 3)")
    p.add_argument("--once", action="store_true", help="reconcile once, print what changed as JSON, exit")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(argv: list[str] | None = None) -> tuple[DiscoveryConfig, argparse.Namespace]:
    a = build_parser().parse_args(argv)
    pools = []
    if a.prefill_dns:
        pools.append(PoolTarget.parse("prefill", a.prefill_dns))
    if a.decode_dns:
        pools.append(PoolTarget.parse("decode", a.decode_dns))
    if a.elastic_dns:
        pools.append(PoolTarget.parse("elastic", a.elastic_dns))
    cfg = DiscoveryConfig(router=a.router, pools=tuple(pools), interval_s=a.interval,
                          absent_rounds=a.absent_rounds, tombstone_s=a.tombstone, timeout_s=a.timeout)
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    try:
        config, args = config_from_args(argv)
    except ConfigError as exc:
        return config_fault("pdserve discovery", exc)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    socket.setdefaulttimeout(config.timeout_s)
    rec = Reconciler(config, HttpRouterApi(config.router, config.timeout_s))
    if args.once:
        res = rec.step()
        print(json.dumps({"added": res.added, "removed": res.removed, "unresolved": res.unresolved,
                          "error": res.error}))
        return 1 if res.error else 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("following %s every %.1f s for %s", ", ".join(f"{p.role}={p.host}:{p.port}" for p in config.pools),
             config.interval_s, config.router)
    rec.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
