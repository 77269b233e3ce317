"""Adapter: Mooncake Transfer Engine as a pdserve data path (RDMA/EFA in production, TCP here).

Optional install: ``pip install mooncake-transfer-engine-non-cuda`` (needs ``libibverbs1``), or the
CUDA build on GPU hosts. Runs Mooncake in P2P-handshake mode (no metadata server). Regions are
registered with Mooncake as well; notifications still travel on pdserve's authenticated control
connection. Mooncake cannot cancel a transfer in flight: a batch past its deadline is reported
failed at the deadline while Mooncake finishes (or fails) the copy in the background.

CUDA regions are registered with their location (``cuda:N``), which Mooncake's CUDA builds
(mooncake-transfer-engine, -cuda13) use for GPUDirect RDMA; the non-CUDA build refuses them here.
"""

from __future__ import annotations

import importlib.metadata
import os
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .backend import Backend, EngineContext
from .batch import BatchHandle, Op, TransferEntry
from .descriptor import SegmentDescriptor
from .errors import TransferError
from .regions import Region

INSTALL_HINT = "pip install mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"
MAX_BATCH_ENTRIES = 1024  # Mooncake TE 0.3.13 fails a 4096-entry batch outright (2048 still passes)


NON_CUDA_DIST = "mooncake-transfer-engine-non-cuda"


def cuda_build() -> bool:
    """False when the installed Mooncake TE is the build without CUDA (it cannot register GPU memory)."""
    try:
        importlib.metadata.distribution(NON_CUDA_DIST)
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


def location(region: Region) -> str:
    """Mooncake's memory location for a region: ``*`` (any NUMA node) for host memory, ``cuda:N`` for GPU."""
    if region.kind == "cpu":
        return "*"
    if region.kind == "cuda" and cuda_build():
        return f"cuda:{region.device}"
    raise TransferError("config", f"region {region.name!r} is on {region.kind}:{region.device} but the installed "
                        f"Mooncake TE ({NON_CUDA_DIST}) has no GPU support: install "
                        "mooncake-transfer-engine-cuda13 (or -transfer-engine), or use backend 'tcp'/'nixl'")


class MooncakeBackend(Backend):
    name = "mooncake"

    def __init__(self, ctx: EngineContext, protocol: str | None = None, device: str | None = None) -> None:
        """protocol/device: Mooncake TE's (tcp | rdma | efa ..., NIC names); default from
        $PDSERVE_MOONCAKE_PROTOCOL (tcp) and $PDSERVE_MOONCAKE_DEVICE (empty: Mooncake picks), which the Helm
        chart sets per worker."""
        super().__init__(ctx)
        protocol = protocol or os.environ.get("PDSERVE_MOONCAKE_PROTOCOL", "tcp")
        device = device if device is not None else os.environ.get("PDSERVE_MOONCAKE_DEVICE", "")
        try:
            from mooncake.engine import TransferEngine as MooncakeEngine
        except ImportError as exc:
            raise TransferError("config", f"backend 'mooncake' needs Mooncake TE: {INSTALL_HINT} ({exc})") from exc
        self._te = MooncakeEngine()
        host = ctx.config.advertise_host or ctx.config.host
        if self._te.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise TransferError("config", f"Mooncake TE failed to initialise on {host} with {protocol}")
        self.session = f"{host}:{self._te.get_rpc_port()}"

    def describe(self) -> dict[str, Any]:
        return {"session": self.session}

    def on_register(self, region: Region) -> None:
        if region.length and self._te.register_memory(region.addr, region.length, location(region)) != 0:
            raise TransferError("config", f"Mooncake TE refused to register region {region.name!r}")

    def on_unregister(self, region: Region) -> None:
        if region.length:
            self._te.unregister_memory(region.addr)

    def supports(self, peer: SegmentDescriptor, timeout: float | None = None) -> bool:
        return "session" in peer.backends.get("mooncake", {})

    def run(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> None:
        regions = self.ctx.regions
        local = [regions.get(e.local_region).addr + e.local_offset for e in entries]
        remote = [peer.regions[e.peer_region][0] + e.peer_offset for e in entries]
        lengths = [e.length for e in entries]
        call = self._te.batch_transfer_sync_write if op is Op.WRITE else self._te.batch_transfer_sync_read
        session = peer.backends["mooncake"]["session"]
        for i in range(0, len(entries), MAX_BATCH_ENTRIES):
            part = slice(i, i + MAX_BATCH_ENTRIES)
            future = self.ctx.executor.submit(call, session, local[part], remote[part], lengths[part])
            try:
                rc = future.result(timeout=handle.remaining())
            except FutureTimeout as exc:
                raise TransferError("deadline",
                                    f"batch {handle.batch_id}: Mooncake transfer missed its deadline") from exc
            if rc != 0:
                raise TransferError("peer", f"batch {handle.batch_id}: Mooncake TE returned {rc} "
                                    "(peer unreachable or range outside its registered memory)")
