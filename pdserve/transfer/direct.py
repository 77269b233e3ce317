"""Same-host direct copies: the initiator moves a batch's bytes itself, with one ``process_vm_readv/writev`` per up
to 1,024 ranges, as NIXL's UCX does over CMA. No request, no reply, no owner thread woken per batch.

The owner stays the authority on its ranges. On first use the initiator asks the owner, over the authenticated Unix
socket, for a **grant**: its pid, its live host-region table (name -> address, length) and the address of an
**epoch** word in its memory. The initiator proves the pid is the owner by reading a random token the owner named in
the same reply; every range of every batch is checked against the grant's table (never against the descriptor the
caller passed, which may be stale or forged). The owner bumps its epoch when a region is unregistered; the initiator
reads the epoch word (one 8-byte copy) before each batch and fetches a new grant when it moved. A peer that gives
no grant (an older engine, a kernel that refuses the copy) is served the old way: the owner copies
(:mod:`pdserve.transfer.local`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, NamedTuple

import numpy as np

from . import procmem
from .batch import TransferEntry
from .errors import TransferError
from .regions import RegionTable

_TOKEN_BYTES = 32


class Grant(NamedTuple):
    """What an owner lets a same-host initiator address directly."""

    pid: int
    epoch_addr: int
    epoch: int
    regions: dict[str, tuple[int, int]]  # host regions: name -> (address, length)


class GrantIssuer:
    """Owner side: the token that proves this process's identity, the epoch word, and the grant message."""

    def __init__(self) -> None:
        self._token = ctypes.create_string_buffer(os.urandom(_TOKEN_BYTES), _TOKEN_BYTES)
        # random start: a process that took a dead owner's pid does not hold the same word at the same address
        self._epoch = ctypes.c_uint64(int.from_bytes(os.urandom(8), "little"))
        self._lock = threading.Lock()

    def bump(self) -> None:
        """A region went away: every grant issued so far is stale."""
        with self._lock:
            self._epoch.value = (self._epoch.value + 1) & ((1 << 64) - 1)

    def message(self, regions: RegionTable) -> dict[str, Any]:
        """The grant as a reply: host regions only (device memory moves by CUDA IPC or staging)."""
        with self._lock:
            epoch = self._epoch.value
        table = {name: entry[:2] for name, entry in regions.describe().items() if len(entry) == 2}
        return {"t": "ok", "pid": os.getpid(), "tok": ctypes.addressof(self._token), "tokv": self._token.raw,
                "ea": ctypes.addressof(self._epoch), "e": epoch, "r": table}


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise TransferError("protocol", f"grant field {value!r} is not an int >= 0")
    return value


def parse_grant(reply: dict[str, Any]) -> Grant:
    """Check an owner's grant reply, and that its pid is the owner: the token it named must read back equal.
    Raises TransferError (``protocol`` for a malformed reply, ``unavailable`` when the copy is not permitted)."""
    pid, token, value, table = _int(reply.get("pid")), _int(reply.get("tok")), reply.get("tokv"), reply.get("r")
    if not isinstance(value, bytes) or len(value) != _TOKEN_BYTES or not isinstance(table, dict):
        raise TransferError("protocol", "grant needs 'tokv' (token bytes) and 'r' (region table)")
    regions = {}
    for name, entry in table.items():
        if not isinstance(name, str) or not isinstance(entry, list) or len(entry) != 2:
            raise TransferError("protocol", f"grant region {name!r}: want [address, length]")
        regions[name] = (_int(entry[0]), _int(entry[1]))
    buf = ctypes.create_string_buffer(_TOKEN_BYTES)
    procmem.copy(pid, procmem.iovecs([(ctypes.addressof(buf), _TOKEN_BYTES)]),
                 procmem.iovecs([(token, _TOKEN_BYTES)]), pull=True)
    if buf.raw != value:
        raise TransferError("unavailable", f"pid {pid} does not hold the owner's token: not the owner")
    return Grant(pid, _int(reply.get("ea")), _int(reply.get("e")), regions)


def current(grant: Grant) -> bool:
    """True while the owner's epoch is the grant's (no region of it has been unregistered since)."""
    return procmem.read_word(grant.pid, grant.epoch_addr) == grant.epoch


_SMALL = 32  # frames of fewer entries are checked in Python; numpy's set-up costs more there


def _unknown(name: str) -> TransferError:
    return TransferError("unknown_region", f"the owner has no host region named {name!r}")


def _out_of_bounds(e: TransferEntry, length: int) -> TransferError:
    return TransferError("bounds", f"range [{e.peer_offset}, {e.peer_offset + e.length}) outside the owner's "
                                   f"region {e.peer_region!r} of {length} bytes")


def iovecs(grant: Grant, regions: RegionTable, frame: list[TransferEntry]) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) iovec arrays of ``frame``; every peer range checked against the grant (``bounds``,
    ``unknown_region``). Local ranges were checked by the engine at submit."""
    if len(frame) < _SMALL:
        return _iovecs_small(grant, regions, frame)
    local_names, local_offsets, peer_names, peer_offsets, lengths = zip(*frame)
    mine = {name: regions.get(name).addr for name in set(local_names)}
    theirs = {}
    for name in set(peer_names):
        entry = grant.regions.get(name)
        if entry is None:
            raise _unknown(name)
        theirs[name] = entry
    n = np.array(lengths, dtype=np.uint64)
    peer_off = np.array(peer_offsets, dtype=np.uint64)
    limit = np.array([theirs[name][1] for name in peer_names], dtype=np.uint64)
    bad = np.flatnonzero((peer_off > limit) | (n > limit - np.minimum(peer_off, limit)))
    if bad.size:
        e = frame[int(bad[0])]
        raise _out_of_bounds(e, theirs[e.peer_region][1])
    local = np.empty((len(frame), 2), dtype=np.uint64)
    local[:, 0] = np.array([mine[name] for name in local_names], dtype=np.uint64) + np.array(local_offsets,
                                                                                              dtype=np.uint64)
    local[:, 1] = n
    remote = np.empty((len(frame), 2), dtype=np.uint64)
    remote[:, 0] = np.array([theirs[name][0] for name in peer_names], dtype=np.uint64) + peer_off
    remote[:, 1] = n
    return local, remote


def _iovecs_small(grant: Grant, regions: RegionTable, frame: list[TransferEntry]) -> tuple[np.ndarray, np.ndarray]:
    local: list[int] = []
    remote: list[int] = []
    for e in frame:
        entry = grant.regions.get(e.peer_region)
        if entry is None:
            raise _unknown(e.peer_region)
        addr, length = entry
        if e.peer_offset < 0 or e.length < 0 or e.peer_offset + e.length > length:
            raise _out_of_bounds(e, length)
        local += (regions.get(e.local_region).addr + e.local_offset, e.length)
        remote += (addr + e.peer_offset, e.length)
    return (np.array(local, dtype=np.uint64).reshape(-1, 2), np.array(remote, dtype=np.uint64).reshape(-1, 2))


def copy(grant: Grant, regions: RegionTable, frame: list[TransferEntry], pull: bool) -> None:
    """Move ``frame``'s bytes between this process and the owner: READ (``pull``) or WRITE."""
    if len(frame) == 1:  # one range (a merged run): no arrays to build
        e = frame[0]
        entry = grant.regions.get(e.peer_region)
        if entry is None:
            raise _unknown(e.peer_region)
        if e.peer_offset < 0 or e.length < 0 or e.peer_offset + e.length > entry[1]:
            raise _out_of_bounds(e, entry[1])
        procmem.copy_one(grant.pid, regions.get(e.local_region).addr + e.local_offset, entry[0] + e.peer_offset,
                         e.length, pull)
        return
    local, remote = iovecs(grant, regions, frame)
    procmem.copy(grant.pid, local, remote, pull)
