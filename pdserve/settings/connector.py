"""The settings of pdserve's KV connector, from ``kv_connector_extra_config`` (moved here from
``pdserve.vllm.params``, which re-exports them): the config layer checks a launch's ``connector_extra`` with
this parser without importing the connector package, and ``lease_s`` has one declaration (the table's).

Nothing here imports vLLM, torch or any other pdserve package but :mod:`pdserve.settings`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .table import LEASE_MAX_S, LEASE_MIN_S, setting

__all__ = ["BACKENDS", "LEASE_MAX_S", "LEASE_MIN_S", "MIN_SECRET_LEN", "SECRET_ENV", "ConfigError",
           "ConnectorConfig"]

SECRET_ENV = "PDSERVE_TRANSFER_SECRET"
MIN_SECRET_LEN = 16
BACKENDS = ("auto", "tcp", "local", "mooncake", "nixl")


LEASE = setting("lease_s")


def _lease(extra: Mapping[str, Any]) -> float:
    """``lease_s`` (a number or a numeric string), checked by the table's one rule."""
    value = extra.get("lease_s", LEASE.default)
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = math.nan
    LEASE.check(value if math.isnan(out) else out, "kv_connector_extra_config.lease_s")
    return out


def _as_float(extra: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = extra.get(key, default)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: give a number of seconds "
                          f"between {lo} and {hi}") from None
    if not lo <= out <= hi or math.isnan(out):
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: use {lo} to {hi} seconds")
    return out


def _as_int(extra: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: give an integer {lo}-{hi}")
    try:
        out = int(value)
    except ValueError:
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: give an integer {lo}-{hi}") from None
    if not lo <= out <= hi:
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: use {lo} to {hi}")
    return out


def _as_bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"kv_connector_extra_config.{key}={value!r}: use true or false")


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings from ``kv_connector_extra_config``.

    secret: transfer-engine secret shared by every worker (or env PDSERVE_TRANSFER_SECRET).
    lease_s: how long P keeps a finished prefill's blocks for a decode that never reads them.
    transfer_host / advertise_host: where this worker's transfer engine listens / is dialled.
    transfer_port: 0 = any free port (the scheduler learns it through vLLM's handshake metadata);
        a fixed port P binds P + tensor-parallel rank.
    backend: transfer-engine data path (auto = same-host copy when possible, else TCP).
    transfer_deadline_s: longest a READ batch may take before D gives up and recomputes.
    clock_margin_s: D stops trusting P's blocks this long before P's lease deadline (clock skew).
    on_load_failure: recompute (default: D recomputes the prompt) or fail (the request errors).
    allow_test_faults: honour ``pdserve_test_fault`` in kv_transfer_params (tests only).
    idle_wait_ms: pace the empty steps vLLM runs while P holds blocks for a decode and has nothing
        else to do (0 = let them spin); a request arriving then waits at most this long.
    pool_master: ``HOST:PORT`` of a KV pool master (pdserve.store); empty = no pool. With a pool, a
        finished request's full blocks are saved to it (asynchronously; the blocks stay held until
        written) and a new request loads the longest pooled prefix beyond the local prefix cache.
    pool_save / pool_load: turn either direction off (default both on when pool_master is set).
    pool_min_blocks: load from the pool only when at least this many blocks are pooled.
    pool_timeout_s: longest a control call to the pool master may take (the scheduler waits on it);
        after a failure the pool is skipped for ``pool_backoff_s``.
    sync_load_max_bytes: D reads P's KV inside its next forward (vLLM's synchronous load: the request is
        scheduled, its KV read before the step's forward and its first token computed in that same step)
        when this rank's read is at most this many bytes; larger reads stay asynchronous (the request
        waits in WAITING_FOR_REMOTE_KVS, so a long transfer never stalls the running decodes). 0 = always
        asynchronous (the behaviour before issue 16).
    sync_load_deadline_s: longest a synchronous read may hold D's step; past it the read fails and vLLM
        recomputes the prompt, as for any failed read.
    """

    secret: str
    lease_s: float = LEASE.default
    transfer_host: str = "127.0.0.1"
    advertise_host: str = ""
    transfer_port: int = 0
    backend: str = "auto"
    streams: int = 4
    transfer_deadline_s: float = 30.0
    clock_margin_s: float = 0.5
    on_load_failure: str = "recompute"
    allow_test_faults: bool = False
    idle_wait_ms: float = 10.0
    pool_master: str = ""
    pool_save: bool = True
    pool_load: bool = True
    pool_min_blocks: int = 1
    pool_timeout_s: float = 1.0
    pool_backoff_s: float = 5.0
    sync_load_max_bytes: int = 32 << 20
    sync_load_deadline_s: float = 2.0

    KEYS = ("secret", "lease_s", "transfer_host", "advertise_host", "transfer_port", "backend", "streams",
            "transfer_deadline_s", "clock_margin_s", "on_load_failure", "allow_test_faults", "idle_wait_ms",
            "pool_master", "pool_save", "pool_load", "pool_min_blocks", "pool_timeout_s", "pool_backoff_s",
            "sync_load_max_bytes", "sync_load_deadline_s")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        extra = dict(extra or {})
        env = os.environ if env is None else env
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has unknown keys {unknown}; "
                              f"PdserveConnector understands {list(cls.KEYS)}")
        secret = extra.get("secret") or env.get(SECRET_ENV, "")
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_LEN:
            raise ConfigError(
                f"PdserveConnector needs a transfer secret of at least {MIN_SECRET_LEN} characters, the "
                f"same on every worker: set kv_connector_extra_config.secret or env {SECRET_ENV}")
        backend = extra.get("backend", "auto")
        if backend not in BACKENDS:
            raise ConfigError(f"kv_connector_extra_config.backend={backend!r}: choose one of {BACKENDS}")
        on_fail = extra.get("on_load_failure", "recompute")
        if on_fail not in ("recompute", "fail"):
            raise ConfigError(f"kv_connector_extra_config.on_load_failure={on_fail!r}: use recompute or fail")
        host = extra.get("transfer_host", "127.0.0.1")
        advertise = extra.get("advertise_host", "")
        if not isinstance(host, str) or not host or not isinstance(advertise, str):
            raise ConfigError("kv_connector_extra_config.transfer_host/advertise_host must be host names "
                              "or IP addresses (strings)")
        if host in ("0.0.0.0", "::") and not advertise:
            raise ConfigError(f"transfer_host={host!r} listens on every interface: also set advertise_host "
                              "to the address decode workers should dial")
        pool = extra.get("pool_master", "") or ""
        if pool:
            host_, sep, port_ = str(pool).rpartition(":")
            if not isinstance(pool, str) or not sep or not host_ or not port_.isdigit() or not 0 < int(port_) < 65536:
                raise ConfigError(f"kv_connector_extra_config.pool_master={pool!r}: give the KV pool master's "
                                  "HOST:PORT (e.g. 127.0.0.1:7600), or leave it empty for no pool")
        return cls(
            secret=secret,
            lease_s=_lease(extra),
            transfer_host=host,
            advertise_host=advertise,
            transfer_port=_as_int(extra, "transfer_port", 0, 0, 65535),
            backend=backend,
            streams=_as_int(extra, "streams", 4, 1, 64),
            transfer_deadline_s=_as_float(extra, "transfer_deadline_s", 30.0, 0.1, 3600.0),
            clock_margin_s=_as_float(extra, "clock_margin_s", 0.5, 0.0, 60.0),
            on_load_failure=on_fail,
            allow_test_faults=_as_bool(extra, "allow_test_faults", False),
            idle_wait_ms=_as_float(extra, "idle_wait_ms", 10.0, 0.0, 1000.0),
            pool_master=pool,
            pool_save=_as_bool(extra, "pool_save", True),
            pool_load=_as_bool(extra, "pool_load", True),
            pool_min_blocks=_as_int(extra, "pool_min_blocks", 1, 1, 1 << 20),
            pool_timeout_s=_as_float(extra, "pool_timeout_s", 1.0, 0.05, 60.0),
            pool_backoff_s=_as_float(extra, "pool_backoff_s", 5.0, 0.0, 3600.0),
            sync_load_max_bytes=_as_int(extra, "sync_load_max_bytes", 32 << 20, 0, 1 << 40),
            sync_load_deadline_s=_as_float(extra, "sync_load_deadline_s", 2.0, 0.01, 60.0),
        )

    @property
    def pool_address(self) -> tuple[str, int] | None:
        if not self.pool_master:
            return None
        host, _, port = self.pool_master.rpartition(":")
        return host, int(port)

    def port_for_rank(self, rank: int) -> int:
        return self.transfer_port + rank if self.transfer_port else 0
