"""One frozen config dataclass per pool process role: the master, a node, and a client (the connector).

Every value is checked on construction; a bad one raises :class:`StoreConfigError` saying how to fix it.
Sizes accept bytes or strings like ``512MiB``, ``4GiB``, ``1G`` (:func:`parse_size`).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from ..settings import ConfigError, Setting, check_fields, write_resolved
from ..settings.secret import shared_secret  # the pool shares the transfer engine's secret

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


class StoreConfigError(ConfigError):
    """A pool setting is wrong; the message names it and says what to use."""


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string like ``512MiB`` / ``4G`` / ``1.5GiB``."""
    if isinstance(value, bool):
        raise StoreConfigError(f"{name}={value!r}: give a byte count such as 1073741824 or '1GiB'")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise StoreConfigError(f"{name}={value!r}: give a byte count such as 1073741824 or '512MiB', '4GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _secret(secret: str) -> str:
    try:
        return shared_secret(secret, "the KV pool", "pass --secret")
    except ConfigError as e:
        raise StoreConfigError(str(e)) from None


# Each value's rule, as the table of settings states one (:class:`~pdserve.settings.spec.Setting`, checked by
# check_fields); the rules across values stay in each config's __post_init__.
def _port(name: str) -> Setting:
    return Setting(name, int, 0, "", ("pool",), minimum=0, maximum=65535,
                   advice="use a TCP port 1-65535, or 0 for a free one")


def _positive(name: str) -> Setting:
    return Setting(name, float, 1.0, "", ("pool",), unit="s", minimum=0, above=True, advice="must be a positive number")


_MASTER = (_port("port"), _port("metrics_port"),
           Setting("replicas", int, 1, "", ("pool",), minimum=1, maximum=16, advice="use 1 to 16 copies per object"),
           _positive("get_lease_s"), _positive("node_timeout_s"), _positive("put_timeout_s"),
           _positive("maintenance_s"),
           Setting("events_kept", int, 100_000, "", ("pool",), minimum=1000, advice="keep at least 1000 events"))
_NODE = (_port("master_port"), _port("port"), _port("transfer_port"), _positive("heartbeat_s"))
_CLIENT = (_port("master_port"), _positive("timeout_s"), _positive("transfer_deadline_s"))


def parse_address(text: str, name: str = "master") -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreConfigError(f"{name}={text!r}: give HOST:PORT, e.g. 127.0.0.1:7600")
    return host, int(port)


@dataclass(frozen=True)
class MasterConfig:
    """The pool master: metadata only (key -> replicas, leases, last use).

    replicas: copies per object, each on a distinct node (fewer when fewer nodes are alive).
    high_watermark / low_watermark: when a node's tier is fuller than ``high`` (fraction of its capacity), its
    least recently used unleased objects leave it until it is at ``low``: host-memory objects spill to that
    node's SSD tier (when it has room), SSD objects are deleted.
    get_lease_s: how long a get keeps its objects from eviction/removal (clients release earlier when done); not
        the connector's ``lease_s`` (how long P holds a finished prefill's blocks for D).
    node_timeout_s: a node silent this long is dropped with its objects.
    put_timeout_s: space allocated by a put that never completes is reclaimed after this long.
    metrics_port: Prometheus text on http://host:metrics_port/metrics (0 = off).
    """

    secret: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    replicas: int = 1
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    get_lease_s: float = 5.0
    node_timeout_s: float = 3.0
    put_timeout_s: float = 30.0
    maintenance_s: float = 0.1
    metrics_port: int = 0
    events_kept: int = 100_000

    def __post_init__(self) -> None:
        write_resolved(self, {"secret": _secret(self.secret)})
        check_fields(self, _MASTER, StoreConfigError)
        if not 0 < self.low_watermark < self.high_watermark <= 1.0:
            raise StoreConfigError(f"watermarks low={self.low_watermark} high={self.high_watermark}: need "
                                   "0 < low < high <= 1 (e.g. low 0.75, high 0.9)")


@dataclass(frozen=True)
class NodeConfig:
    """A store node: lends ``mem_bytes`` of host memory (one registered arena) and ``disk_bytes`` in
    ``disk_dir`` (0 = no SSD tier) to the pool run by the master at ``master_host:master_port``.

    host/port: the node's control listener (the master calls it to spill and promote); its transfer engine
    listens on ``transfer_port`` (0 = free port); workers read and write the arena through it directly.
    heartbeat_s: how often the node tells the master it is alive (keep well under the master's node_timeout_s).
    """

    master_host: str
    master_port: int
    mem_bytes: int | str = 1 << 30
    disk_dir: str = ""
    disk_bytes: int | str = 0
    secret: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    transfer_port: int = 0
    advertise_host: str = ""
    transfer_backend: str = "auto"
    node_id: str = ""
    heartbeat_s: float = 0.5

    def __post_init__(self) -> None:
        write_resolved(self, {"secret": _secret(self.secret), "mem_bytes": parse_size(self.mem_bytes, "mem_bytes"),
                              "disk_bytes": parse_size(self.disk_bytes, "disk_bytes"),
                              "node_id": self.node_id or f"{socket.gethostname()}-{os.getpid()}"})
        check_fields(self, _NODE, StoreConfigError)
        if self.master_port == 0:
            raise StoreConfigError("master_port=0: give the master's port (--master HOST:PORT)")
        if int(self.mem_bytes) < 1 << 20:
            raise StoreConfigError(f"mem_bytes={self.mem_bytes}: lend at least 1MiB of host memory")
        if int(self.disk_bytes) < 0:
            raise StoreConfigError(f"disk_bytes={self.disk_bytes}: must be >= 0 (0 = no SSD tier)")
        if int(self.disk_bytes) > 0 and not self.disk_dir:
            raise StoreConfigError("disk_bytes > 0 needs disk_dir: the directory the SSD tier writes files into "
                                   "(--disk-dir DIR)")
        if self.disk_dir and int(self.disk_bytes) > 0:
            d = os.path.abspath(self.disk_dir)
            parent = d if os.path.isdir(d) else os.path.dirname(d)
            if not os.access(parent, os.W_OK):
                raise StoreConfigError(f"disk_dir={self.disk_dir!r}: {parent} is not writable")
        if self.host in ("0.0.0.0", "::") and not self.advertise_host:
            raise StoreConfigError(f"host={self.host!r} listens on every interface: also set advertise_host to "
                                   "the address the master and workers should dial")


@dataclass(frozen=True)
class ClientConfig:
    """A pool client (the connector in every vLLM worker): where the master is and how long to wait.

    timeout_s: one control call to the master; transfer_deadline_s: one batch of reads or writes to nodes.
    """

    master_host: str
    master_port: int
    secret: str = ""
    timeout_s: float = 5.0
    transfer_deadline_s: float = 4.0  # keep under the master's get_lease_s: reads end while leased

    def __post_init__(self) -> None:
        write_resolved(self, {"secret": _secret(self.secret)})
        check_fields(self, _CLIENT, StoreConfigError)
        if self.master_port == 0:
            raise StoreConfigError("master_port=0: give the pool master's port (HOST:PORT)")
