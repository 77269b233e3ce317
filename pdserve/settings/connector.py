"""The settings of pdserve's KV connector, from ``kv_connector_extra_config`` (moved here from
``pdserve.vllm.params``, which re-exports them): the config layer checks a launch's ``connector_extra`` with
this parser without importing the connector package, and ``lease_s`` has one declaration (the table's).

Nothing here imports vLLM, torch or any other pdserve package but :mod:`pdserve.settings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .rules import check_host_port
from .secret import MIN_SECRET_LEN, SECRET_ENV, shared_secret
from .spec import Setting
from .table import BACKENDS, LEASE_MAX_S, LEASE_MIN_S, setting

__all__ = ["BACKENDS", "LEASE_MAX_S", "LEASE_MIN_S", "MIN_SECRET_LEN", "SECRET_ENV", "ConfigError",
           "ConnectorConfig"]

_PREFIX = "kv_connector_extra_config."


def _coerce(s: Setting, raw: Any) -> Any:
    """A value as its kind, from JSON or text (``"2.5"``, ``"true"``); ``raw`` itself when it is no such value
    (the table's check then refuses it)."""
    try:
        if s.kind is float and isinstance(raw, (int, float, str)) and not isinstance(raw, bool):
            return float(raw)
        if s.kind is int and isinstance(raw, (int, str)) and not isinstance(raw, bool):
            return int(raw)
    except ValueError:
        return raw
    if s.kind is bool and isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
        return raw.lower() in ("true", "1")
    return raw


def _value(extra: Mapping[str, Any], name: str) -> Any:
    """Setting ``name`` from ``extra`` (else its default), checked by the table's rule."""
    s = setting(name)
    value = _coerce(s, extra.get(name, s.default))
    s.check(value, _PREFIX + name)
    return value


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
    handoff_wait_s: longest D waits for P's prefill in an early hand-off before it computes the prompt itself.
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
        asynchronous (every read as a load of its own).
    sync_load_deadline_s: longest a synchronous read may hold D's step; past it the read fails and vLLM
        recomputes the prompt, as for any failed read.
    kv_checksum: checksum every KV block that crosses a process (P's leased blocks, pool objects) and verify it
        before vLLM uses the block (default on; false turns both sides off: P seals nothing and D verifies
        nothing; pool objects still carry their fingerprint).
    layerwise_kv: an early hand-off's KV moves layer by layer (P announces each layer as its attention writes it;
        D reads and verifies each one while P computes the rest); false: the whole prompt after P's last forward.
    layer_batch_bytes: a layer-by-layer read waits for enough new layers that its batch carries this many bytes.
    """

    secret: str
    lease_s: float = setting("lease_s").default
    transfer_host: str = setting("transfer_host").default
    advertise_host: str = setting("advertise_host").default
    transfer_port: int = setting("transfer_port").default
    backend: str = setting("backend").default
    streams: int = setting("streams").default
    transfer_deadline_s: float = setting("transfer_deadline_s").default
    handoff_wait_s: float = setting("handoff_wait_s").default
    clock_margin_s: float = setting("clock_margin_s").default
    on_load_failure: str = setting("on_load_failure").default
    allow_test_faults: bool = setting("allow_test_faults").default
    idle_wait_ms: float = setting("idle_wait_ms").default
    pool_master: str = setting("pool_master").default
    pool_save: bool = setting("pool_save").default
    pool_load: bool = setting("pool_load").default
    pool_min_blocks: int = setting("pool_min_blocks").default
    pool_timeout_s: float = setting("pool_timeout_s").default
    pool_backoff_s: float = setting("pool_backoff_s").default
    sync_load_max_bytes: int = setting("sync_load_max_bytes").default
    sync_load_deadline_s: float = setting("sync_load_deadline_s").default
    kv_checksum: bool = setting("kv_checksum").default
    layerwise_kv: bool = setting("layerwise_kv").default
    layer_batch_bytes: int = setting("layer_batch_bytes").default

    KEYS = ("secret", "lease_s", "transfer_host", "advertise_host", "transfer_port", "backend", "streams",
            "transfer_deadline_s", "handoff_wait_s", "clock_margin_s", "on_load_failure", "allow_test_faults",
            "idle_wait_ms",
            "pool_master", "pool_save", "pool_load", "pool_min_blocks", "pool_timeout_s", "pool_backoff_s",
            "sync_load_max_bytes", "sync_load_deadline_s", "kv_checksum", "layerwise_kv", "layer_batch_bytes")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        extra = dict(extra or {})
        env = os.environ if env is None else env
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has unknown keys {unknown}; "
                              f"PdserveConnector understands {list(cls.KEYS)}")
        secret = shared_secret(extra.get("secret"), "PdserveConnector", "set kv_connector_extra_config.secret", env)
        host, advertise = _value(extra, "transfer_host"), _value(extra, "advertise_host")
        if host in ("0.0.0.0", "::") and not advertise:
            raise ConfigError(f"transfer_host={host!r} listens on every interface: also set advertise_host "
                              "to the address decode workers should dial")
        pool = extra.get("pool_master", "") or ""
        check_host_port(pool, _PREFIX + "pool_master", "the KV pool master's HOST:PORT (e.g. 127.0.0.1:7600), or "
                        "leave it empty for no pool")
        values = {name: _value(extra, name) for name in cls.KEYS if name not in ("secret", "pool_master")}
        return cls(secret=secret, pool_master=pool, **values)

    @property
    def pool_address(self) -> tuple[str, int] | None:
        if not self.pool_master:
            return None
        host, _, port = self.pool_master.rpartition(":")
        return host, int(port)

    def port_for_rank(self, rank: int) -> int:
        return self.transfer_port + rank if self.transfer_port else 0
