"""Adapter: NIXL (UCX; EFA and others through NIXL's plugins) as a pdserve data path.

Optional install: ``pip install nixl`` (here ``pip install --no-deps nixl-cu13 nixl``). The agent runs
without a progress thread (NIXL's default one busy-polls a whole core); transfers are driven by
polling their state, and a 1 ms progress tick serves transfers targeting this process. Peers exchange NIXL
agent metadata through the segment descriptor; a peer whose
metadata changed (it registered more memory) is re-added. Notifications travel on pdserve's control
connection, like every backend's. NIXL tends to crash at interpreter exit: processes using this
backend should end with ``os._exit``.

CUDA regions are registered as NIXL ``VRAM`` with their device index, so UCX can take cuda_ipc (same host)
or GPUDirect RDMA; a batch whose entries mix memory kinds becomes one NIXL transfer per (local, peer) kind.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

from .backend import Backend, EngineContext
from .batch import BatchHandle, Op, TransferEntry
from .descriptor import SegmentDescriptor
from .errors import TransferError
from .regions import Region

INSTALL_HINT = "pip install --no-deps nixl-cu13 nixl (CPU hosts) or pip install nixl"
_POLL_S = 50e-6
_PROGRESS_S = 1e-3
_MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}


class NixlBackend(Backend):
    name = "nixl"

    def __init__(self, ctx: EngineContext, plugin: str = "UCX") -> None:
        super().__init__(ctx)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise TransferError("config", f"backend 'nixl' needs NIXL: {INSTALL_HINT} ({exc})") from exc
        self._agent = nixl_agent(ctx.engine_id, nixl_agent_config(enable_prog_thread=False, backends=[plugin]))
        self._lock = threading.Lock()  # the agent is driven from several batch threads
        self._registrations: dict[str, Any] = {}
        self._peers: dict[str, str] = {}  # peer engine id -> digest of the metadata we loaded
        self._closed = threading.Event()
        threading.Thread(target=self._progress, name="pdserve-nixl-progress", daemon=True).start()

    def _progress(self) -> None:
        """Without NIXL's own (busy-polling) thread, UCX rendezvous needs the target side to make
        progress now and then; a 1 ms tick does it at a negligible share of a core."""
        while not self._closed.wait(_PROGRESS_S):
            with self._lock:
                self._agent.get_new_notifs()

    def close(self) -> None:
        self._closed.set()

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"metadata": self._agent.get_agent_metadata()}

    def on_register(self, region: Region) -> None:
        with self._lock:
            self._registrations[region.name] = self._agent.register_memory(
                [(region.addr, region.length, region.device, "")], _MEM_TYPES[region.kind])

    def on_unregister(self, region: Region) -> None:
        with self._lock:
            reg = self._registrations.pop(region.name, None)
            if reg is not None:
                self._agent.deregister_memory(reg)

    def supports(self, peer: SegmentDescriptor, timeout: float | None = None) -> bool:
        return "metadata" in peer.backends.get("nixl", {})

    def _remote_agent(self, peer: SegmentDescriptor) -> str:
        metadata = peer.backends["nixl"]["metadata"]
        digest = hashlib.sha256(metadata).hexdigest()
        if self._peers.get(peer.engine_id) != digest:
            if peer.engine_id in self._peers:
                self._agent.remove_remote_agent(peer.engine_id)
            self._agent.add_remote_agent(metadata)
            self._peers[peer.engine_id] = digest
        return peer.engine_id

    def _groups(self, peer: SegmentDescriptor, entries: list[TransferEntry]
                ) -> dict[tuple[str, str], tuple[list, list]]:
        """Entries as NIXL (address, length, device) descriptors, one pair of lists per (local, peer) kind."""
        groups: dict[tuple[str, str], tuple[list, list]] = {}
        for e in entries:
            mine = self.ctx.regions.get(e.local_region)
            kind, device = peer.memory(e.peer_region)
            local, remote = groups.setdefault((mine.kind, kind), ([], []))
            local.append((mine.addr + e.local_offset, e.length, mine.device))
            remote.append((peer.regions[e.peer_region][0] + e.peer_offset, e.length, device))
        return groups

    def run(self, handle: BatchHandle, peer: SegmentDescriptor, op: Op, entries: list[TransferEntry]) -> None:
        xfers: list[Any] = []
        states: list[str] = []
        try:
            with self._lock:
                name = self._remote_agent(peer)
                for (mine, theirs), (local, remote) in self._groups(peer, entries).items():
                    xfer = self._agent.initialize_xfer(
                        op.value.upper(), self._agent.get_xfer_descs(local, _MEM_TYPES[mine]),
                        self._agent.get_xfer_descs(remote, _MEM_TYPES[theirs]), name, b"")
                    xfers.append(xfer)
                    states.append(self._agent.transfer(xfer))
            for xfer, state in zip(xfers, states):
                self._wait(handle, xfer, state)
        finally:
            with self._lock:
                for xfer in xfers:
                    try:
                        self._agent.release_xfer_handle(xfer)  # also cancels one still in flight
                    except Exception:  # NIXL refuses to release some states; the agent cleans up at exit
                        pass

    def _wait(self, handle: BatchHandle, xfer: Any, state: str) -> None:
        while state == "PROC":
            if not handle.active or time.monotonic() > handle.deadline:
                handle.remaining()  # raises the deadline / abort error
            time.sleep(_POLL_S)
            with self._lock:
                state = self._agent.check_xfer_state(xfer)
        if state != "DONE":
            raise TransferError("peer", f"batch {handle.batch_id}: NIXL transfer ended in state {state}")
