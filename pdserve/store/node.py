"""A pool store node process: lends a host-memory arena and an SSD directory to the pool.

The arena is one buffer registered with a :class:`~pdserve.transfer.TransferEngine` as region ``arena``:
workers write and read objects there directly (the master only says at which offsets). The node keeps
a catalog of what it holds (fed by the journal in the master's heartbeat replies and by its own spills and
promotions) so that after a master restart it re-registers everything; after its own restart it
re-registers the objects still in its SSD directory. The master calls it to ``spill`` (arena -> file)
and ``promote`` (file -> arena).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from pdserve.transfer import TransferConfig, TransferEngine

from .config import NodeConfig
from .rpc import RpcClient, RpcServer, StoreError
from .tiers import DiskTier

log = logging.getLogger("pdserve.store.node")
ARENA = "arena"  # region name workers address


class StoreNode:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.arena = np.zeros(int(config.mem_bytes), dtype=np.uint8)  # pages committed on first write
        self._view = self.arena.data  # a memoryview of the arena's bytes
        self.engine = TransferEngine(TransferConfig(secret=config.secret, host=config.host,
                                                    advertise_host=config.advertise_host,
                                                    port=config.transfer_port, backend=config.transfer_backend))
        self.engine.register(ARENA, self.arena)
        self.disk = DiskTier(config.disk_dir, int(config.disk_bytes)) if int(config.disk_bytes) else None
        self._lock = threading.Lock()
        self.mem: dict[int, tuple[int, int]] = {}  # key -> (offset, size)
        self.ssd: dict[int, int] = {}  # key -> size
        if self.disk is not None:
            self.ssd.update(self.disk.scan())
        self._ack = 0
        self._stop = threading.Event()
        self.server = RpcServer(config.host, config.port, config.secret,
                                {"spill": self._spill, "promote": self._promote, "ping": lambda a: "pong",
                                 "info": self._info}, f"pdserve-store-node-{self.node_id}")
        self.port = self.server.port
        self.master = RpcClient(config.master_host, config.master_port, config.secret, timeout_s=5.0)
        self.registered = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat_loop, name="pdserve-store-hb", daemon=True)
        self._hb.start()
        log.info("node %s: arena %d B, SSD %d B in %s, control %s:%d, transfer %d", self.node_id,
                 self.arena.nbytes, int(config.disk_bytes), config.disk_dir or "-", config.host, self.port,
                 self.engine.segment().port)

    # ---- master link
    def _objects(self) -> list[list[Any]]:
        with self._lock:
            return ([[k, "mem", off, size] for k, (off, size) in self.mem.items()]
                    + [[k, "ssd", -1, size] for k, size in self.ssd.items()])

    def _register(self) -> None:
        host = self.config.advertise_host or self.config.host
        res = self.master.call("register", node_id=self.node_id, rpc=[host, self.port],
                               segment=self.engine.segment().to_wire(), mem_capacity=self.arena.nbytes,
                               ssd_capacity=int(self.config.disk_bytes), objects=self._objects())
        self._ack = 0
        log.info("node %s: registered with the master at %s:%d (%s)", self.node_id, self.config.master_host,
                 self.config.master_port, res)
        self.registered.set()

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    self._register()
                reply = self.master.call("heartbeat", node_id=self.node_id, ack=self._ack)
                if not reply.get("known"):
                    log.warning("node %s: the master does not know us (it restarted?): registering again",
                                self.node_id)
                    self.registered.clear()
                    continue
                self._apply(reply.get("events") or [])
            except StoreError as exc:
                if self.registered.is_set():
                    log.warning("node %s: master unreachable (%s); retrying", self.node_id, exc)
                self.registered.clear()
            except Exception:
                log.exception("node %s: heartbeat failed", self.node_id)
            self._stop.wait(self.config.heartbeat_s)

    def _apply(self, events: list[list[Any]]) -> None:
        for seq, op, key, tier, offset, size in events:
            if seq <= self._ack:
                continue
            with self._lock:
                if op == "add" and tier == "mem":
                    self.mem[key] = (offset, size)
                elif op == "add" and tier == "ssd":
                    self.ssd[key] = size
                elif op == "del" and tier == "mem":
                    self.mem.pop(key, None)
                elif op == "del" and tier == "ssd":
                    self.ssd.pop(key, None)
                    if self.disk is not None:
                        self.disk.remove(key)
            self._ack = seq

    # ---- calls from the master
    def _span(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size <= 0 or offset + size > self.arena.nbytes:
            raise StoreError("bounds", f"[{offset}, {offset + size}) outside the {self.arena.nbytes}-byte arena")
        return self._view[offset:offset + size]

    def _spill(self, a: dict[str, Any]) -> list[bool]:
        out = []
        for key, offset, size in a["items"]:
            try:
                if self.disk is None:
                    raise OSError("this node has no SSD tier")
                self.disk.write(key, self._span(offset, size))
                with self._lock:
                    self.ssd[key] = size
                out.append(True)
            except (OSError, StoreError) as exc:
                log.warning("node %s: spill of %016x failed: %s", self.node_id, key, exc)
                out.append(False)
        return out

    def _promote(self, a: dict[str, Any]) -> list[bool]:
        out = []
        for key, offset, size in a["items"]:
            try:
                if self.disk is None:
                    raise OSError("this node has no SSD tier")
                self.disk.read_into(key, self._span(offset, size))
                with self._lock:
                    self.mem[key] = (offset, size)
                out.append(True)
            except (OSError, StoreError) as exc:
                log.warning("node %s: promote of %016x failed: %s", self.node_id, key, exc)
                out.append(False)
        return out

    def _info(self, a: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return {"node_id": self.node_id, "mem_objects": len(self.mem), "ssd_objects": len(self.ssd),
                    "ssd_bytes": self.disk.used if self.disk else 0, "transfer_port": self.engine.segment().port}

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        self.master.close()
        self.engine.close()
