"""Graceful drain of one worker, run as its Kubernetes preStop hook (or by hand before stopping a worker).

    python -m pdserve.kube.drain --router http://pd-pdserve-router-peers.llm.svc:8000 \\
        --self http://10.0.3.17:8000 --metrics-url http://127.0.0.1:8000/metrics --timeout 120 --hold 35

1. Deregister: ``DELETE /v1/pdserve/workers {"url": SELF}`` on *every* router replica: the router's host name
   is resolved and each address is called (the chart passes a headless Service that lists every router pod).
   The routers stop sending this worker new requests at once; requests already on it go on. The routers'
   admin token is read from $PDSERVE_ADMIN_TOKEN.
2. Wait until the worker is idle: its vLLM ``/metrics`` shows ``vllm:num_requests_running`` +
   ``vllm:num_requests_waiting`` == 0, and every gauge the pdserve connector exports about KV it holds
   (``vllm:pdserve_kv_*`` gauges, when present) == 0, on ``quiet_polls`` polls in a row (a request the router
   sent just before the DELETE may still be on the wire).
3. Hold: when the connector exports no held-KV gauge, stay up ``hold`` seconds more, so decode workers can still
   read the KV a prefill worker leased to them (set it to the connector's ``lease_s`` on prefill workers).
4. Exit 0; the kubelet then sends SIGTERM and vLLM frees its KV cache as it exits. Exit 1 when ``timeout``
   passed first, saying what was still busy (the kubelet goes on with SIGTERM anyway).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..prom import parse, types
from ..settings.errors import ConfigError, config_fault
from ..settings.spec import Setting, check_fields, write_resolved
from .discovery import TOKEN_ENV, WORKERS_PATH, worker_url

log = logging.getLogger("pdserve.kube.drain")

BUSY_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
KV_GAUGE_PREFIX = "vllm:pdserve_kv_"

__all__ = ["DrainConfig", "DrainConfigError", "DrainResult", "busy_counts", "deregister", "drain", "main",
           "parse_prometheus", "router_targets"]


class DrainConfigError(ConfigError):
    """A drain setting is wrong; the message says which and how to fix it."""


def _check_url(flag: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DrainConfigError(f"{flag} {url!r}: give a base URL like http://10.0.0.5:8000")
    return url.rstrip("/")


# each value's rule, as the table of settings states one (checked by check_fields, named by its flag)
_SETTINGS = (
    Setting("timeout_s", float, 120.0, "", (), minimum=0, above=True, flag="--timeout", advice="must be > 0 seconds"),
    Setting("hold_s", float, 0.0, "", (), minimum=0, flag="--hold", advice="must be >= 0 seconds"),
    Setting("poll_s", float, 1.0, "", (), minimum=0, above=True, flag="--poll", advice="must be > 0 seconds"),
    Setting("quiet_polls", int, 2, "", (), minimum=1, advice="use 1 or more"),
    Setting("http_timeout_s", float, 3.0, "", (), minimum=0, above=True, flag="http_timeout_s",
            advice="must be > 0 seconds"),
)


@dataclass(frozen=True)
class DrainConfig:
    """Settings of one drain.

    routers: router base URLs; each host name is resolved and every address gets the DELETE.
    self_url: this worker's URL exactly as the routers know it (the pod IP, as discovery registers it).
    metrics_url: this worker's vLLM /metrics (default: self_url + /metrics).
    timeout_s: give up waiting for idle after this long (exit 1).
    hold_s: stay up this long after idle when the connector reports no held-KV gauge.
    poll_s / quiet_polls: poll period, and how many idle polls in a row count as idle.
    """

    routers: tuple[str, ...]
    self_url: str
    metrics_url: str = ""
    timeout_s: float = 120.0
    hold_s: float = 0.0
    poll_s: float = 1.0
    quiet_polls: int = 2
    http_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if not self.routers:
            raise DrainConfigError("give at least one --router URL (the routers to deregister from)")
        self_url = _check_url("--self", self.self_url)
        write_resolved(self, {"routers": tuple(_check_url("--router", u) for u in self.routers), "self_url": self_url,
                              "metrics_url": self.metrics_url or self_url + "/metrics"})
        if urlsplit(self.self_url).path.strip("/"):
            raise DrainConfigError(f"--self {self.self_url!r}: give the worker's base URL (no path)")
        check_fields(self, _SETTINGS, DrainConfigError, flags=True)


@dataclass
class DrainResult:
    deregistered: list[str]
    deregister_errors: list[str]
    idle: bool
    waited_s: float
    held_s: float
    last_busy: dict[str, float]
    message: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


# ------------------------------------------------------------------------------- deregistration


def router_targets(router_url: str, resolve: Callable[[str, int], Iterable[str]] | None = None) -> list[str]:
    """Every address behind ``router_url``'s host, as base URLs (the name itself when it does not resolve)."""
    parts = urlsplit(router_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not parts.hostname:
        return [router_url]
    try:
        if resolve is None:
            addrs = sorted({str(i[4][0]) for i in socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)})
        else:
            addrs = sorted(set(resolve(parts.hostname, port)))
    except OSError as exc:
        log.warning("resolving %s failed (%s); calling it by name", parts.hostname, exc)
        return [router_url]
    return [worker_url(a, port, parts.scheme) for a in addrs] or [router_url]


def _http(method: str, url: str, body: dict | None, timeout_s: float, token: str = "") -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def deregister(config: DrainConfig, resolve: Callable[[str, int], Iterable[str]] | None = None
               ) -> tuple[list[str], list[str]]:
    """DELETE this worker on every router address: (routers that dropped it, errors)."""
    done, errors = [], []
    token = os.environ.get(TOKEN_ENV, "")
    for router in config.routers:
        for target in router_targets(router, resolve):
            url = target + WORKERS_PATH
            try:
                status, body = _http("DELETE", url, {"url": config.self_url}, config.http_timeout_s, token)
            except (urllib.error.URLError, OSError) as exc:
                errors.append(f"{target}: {exc}")
                continue
            if status in (200, 202, 204, 404):  # 404: it was not a member there (already removed)
                done.append(target)
            else:
                hint = f" (set ${TOKEN_ENV} to the router's admin token)" if status in (401, 403) else ""
                errors.append(f"{target}: HTTP {status} {body[:200].decode(errors='replace')}{hint}")
    return done, errors


# ------------------------------------------------------------------------------------- metrics


def parse_prometheus(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Prometheus text exposition -> ({metric name: sum over its label sets}, {metric name: TYPE})."""
    return parse(text), types(text)


def busy_counts(text: str) -> tuple[dict[str, float], bool]:
    """(what keeps the worker busy: metric -> value, whether the connector exports a held-KV gauge)."""
    sums, types = parse_prometheus(text)
    missing = [m for m in BUSY_METRICS if m not in sums]
    if missing:
        raise ValueError(f"metrics lack {missing}: is this a vLLM server's /metrics?")
    busy = {m: sums[m] for m in BUSY_METRICS}
    # prometheus_client also exports "<counter>_created" timestamps typed as gauges: those are not held KV
    kv = {m: v for m, v in sums.items()
          if m.startswith(KV_GAUGE_PREFIX) and types.get(m) == "gauge" and not m.endswith("_created")}
    busy.update(kv)
    return busy, bool(kv)


# ---------------------------------------------------------------------------------------- drain


def drain(config: DrainConfig, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep,
          resolve: Callable[[str, int], Iterable[str]] | None = None) -> DrainResult:
    t0 = clock()
    done, errors = deregister(config, resolve)
    for e in errors:
        log.warning("deregistering from %s", e)
    log.info("deregistered %s from %d router(s)", config.self_url, len(done))

    last: dict[str, float] = {}
    quiet, has_kv_gauge, idle = 0, False, False
    while True:
        try:
            status, body = _http("GET", config.metrics_url, None, config.http_timeout_s)
            if status != 200:
                raise OSError(f"HTTP {status}")
            last, has_kv_gauge = busy_counts(body.decode(errors="replace"))
        except (urllib.error.URLError, OSError) as exc:
            # the server is gone or not serving: nothing left to drain
            return DrainResult(done, errors, True, clock() - t0, 0.0, last,
                               f"{config.metrics_url} unreachable ({exc}): nothing to drain")
        except ValueError as exc:
            return DrainResult(done, errors, False, clock() - t0, 0.0, last, str(exc))
        if not any(v > 0 for v in last.values()):
            quiet += 1
            if quiet >= config.quiet_polls:
                idle = True
                break
        else:
            quiet = 0
        if clock() - t0 >= config.timeout_s:
            break
        sleep(config.poll_s)
    waited = clock() - t0
    if not idle:
        busy = {k: v for k, v in last.items() if v > 0}
        return DrainResult(done, errors, False, waited, 0.0, last,
                           f"still busy after {config.timeout_s:g} s: {busy}; SIGTERM will abort it")
    held = 0.0
    if config.hold_s > 0 and not has_kv_gauge:
        held = max(0.0, min(config.hold_s, config.timeout_s + config.hold_s - waited))
        log.info("idle; holding %.0f s so decode workers can still read leased KV", held)
        sleep(held)
    return DrainResult(done, errors, True, waited, held, last, f"idle after {waited:.1f} s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.kube.drain",
                                description="Take a worker out of the routers and wait until it is idle "
                                            "(Kubernetes preStop hook).")
    p.add_argument("--router", action="append", required=True, metavar="URL",
                   help="router base URL; its host is resolved and every address is told (repeatable)")
    p.add_argument("--self", dest="self_url", required=True, metavar="URL",
                   help="this worker's base URL as the routers know it, e.g. http://$POD_IP:8000")
    p.add_argument("--metrics-url", default="", help="vLLM /metrics of this worker (default: SELF/metrics)")
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for idle, seconds (default 120)")
    p.add_argument("--hold", type=float, default=0.0,
                   help="seconds to stay up once idle when the connector exports no held-KV gauge "
                        "(prefill workers: the connector's lease_s)")
    p.add_argument("--poll", type=float, default=1.0, help="metrics poll period (default 1 s)")
    p.add_argument("--quiet-polls", type=int, default=2, help="idle polls in a row that count as idle")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        config = DrainConfig(routers=tuple(a.router), self_url=a.self_url, metrics_url=a.metrics_url,
                             timeout_s=a.timeout, hold_s=a.hold, poll_s=a.poll, quiet_polls=a.quiet_polls)
    except ConfigError as exc:
        return config_fault("pdserve drain", exc)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = drain(config)
    print(result.to_json(), flush=True)
    if not result.idle:
        print(f"pdserve drain: {result.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
