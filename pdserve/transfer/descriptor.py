"""Segment descriptors: the small msgpack-able value peers use to address an engine's memory."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .errors import TransferError
from .regions import check_range


def host_identity() -> str:
    """Same value for processes that share a kernel and a PID namespace (the same-host path needs both)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return f"unknown-{os.getpid()}"  # never equal to another process's identity
    return f"{boot}/{pidns}"


MEMORY_KINDS = ("cpu", "cuda")


def _region_entry(v: Any) -> list[Any]:
    if len(v) == 2:
        return [int(v[0]), int(v[1])]
    if len(v) == 4 and v[2] in MEMORY_KINDS:
        return [int(v[0]), int(v[1]), str(v[2]), int(v[3])]
    raise ValueError(f"region entry {v!r}: want [address, length] or [address, length, kind, device]")


@dataclass(frozen=True)
class SegmentDescriptor:
    """Where an engine listens and which regions it exposes: name -> [address, length] for host memory,
    [address, length, kind, device index] for device memory (kind ``cuda``)."""

    engine_id: str
    host: str
    port: int
    pid: int
    host_id: str
    regions: dict[str, list[Any]] = field(default_factory=dict)
    backends: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id, "host": self.host, "port": self.port, "pid": self.pid,
            "host_id": self.host_id, "regions": self.regions, "backends": self.backends,
        }

    @classmethod
    def from_wire(cls, data: Any) -> SegmentDescriptor:
        try:
            desc = cls(
                engine_id=str(data["engine_id"]), host=str(data["host"]), port=int(data["port"]),
                pid=int(data["pid"]), host_id=str(data["host_id"]),
                regions={str(k): _region_entry(v) for k, v in data.get("regions", {}).items()},
                backends=dict(data.get("backends", {})),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise TransferError("protocol", f"malformed segment descriptor: {exc!r}") from exc
        return desc

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def is_same_host(self, other_host_id: str) -> bool:
        return self.host_id == other_host_id

    def region_length(self, region: str) -> int:
        if region not in self.regions:
            raise TransferError("unknown_region", f"peer {self.engine_id} has no region {region!r}")
        return self.regions[region][1]

    def memory(self, region: str) -> tuple[str, int]:
        """(kind, device index) of a peer region: ("cpu", 0) for host memory."""
        entry = self.regions.get(region)
        if entry is None:
            raise TransferError("unknown_region", f"peer {self.engine_id} has no region {region!r}")
        return (entry[2], entry[3]) if len(entry) == 4 else ("cpu", 0)

    def check(self, region: str, offset: int, length: int) -> None:
        """Initiator-side pre-check; the owner checks again on its side."""
        check_range(region, self.region_length(region), offset, length)
