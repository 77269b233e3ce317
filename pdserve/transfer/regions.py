"""Registered memory regions: the only bytes a peer may read or write.

Host memory (numpy, CPU tensors, mmap, bytearray) is addressed directly through a flat byte view (a tensor's:
:mod:`.views`, which :mod:`.cuda` uses too, so that this module imports :mod:`.cuda` and not the reverse). CUDA
tensors, and any :class:`~pdserve.transfer.staging.StagedMemory`, have no host view: backends move them
through staging buffers (tcp), CUDA IPC (same host) or their own GPU path (NIXL, Mooncake).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import TransferError
from .staging import StagedMemory
from .views import byte_tensor, dense_nbytes, host_view

__all__ = ["Region", "RegionTable", "as_byte_view", "byte_tensor", "check_range", "dense_nbytes", "host_view"]


@dataclass(frozen=True)
class Region:
    """A named, registered, writable byte range of this process."""

    name: str
    view: memoryview | None  # flat, format "B", writable; None for memory the CPU cannot address
    addr: int
    length: int
    owner: Any  # keeps the underlying buffer alive
    staged: StagedMemory | None = None  # set for device memory: what moves it through host buffers

    @property
    def kind(self) -> str:
        return self.staged.kind if self.staged is not None else "cpu"

    @property
    def device(self) -> int:
        return self.staged.device if self.staged is not None else 0

    def slice(self, offset: int, length: int) -> memoryview:
        check_range(self.name, self.length, offset, length)
        if self.view is None:
            raise TransferError("config", f"region {self.name!r} is {self.kind}:{self.device} memory, "
                                          "which has no host view; it moves through staging")
        return self.view[offset : offset + length]

    def part(self, offset: int, length: int) -> memoryview | tuple[StagedMemory, int, int]:
        """The bytes [offset, offset+length) as a host view, or as a piece to stage when staged."""
        check_range(self.name, self.length, offset, length)
        if self.staged is not None:
            return (self.staged, offset, length)
        return self.view[offset : offset + length]  # type: ignore[index]

    def describe(self) -> list[Any]:
        """The descriptor entry: [address, length] for host memory (the wire CPU peers always spoke),
        [address, length, kind, device index] otherwise."""
        if self.kind == "cpu":
            return [self.addr, self.length]
        return [self.addr, self.length, self.kind, self.device]


def check_range(name: str, region_length: int, offset: int, length: int) -> None:
    """Raise ``bounds`` unless [offset, offset+length) lies inside a region of region_length bytes."""
    if not (isinstance(offset, int) and isinstance(length, int)):
        raise TransferError("protocol", f"region {name!r}: offset and length must be integers")
    if offset < 0 or length < 0 or offset + length > region_length:
        raise TransferError(
            "bounds",
            f"range [{offset}, {offset + length}) outside region {name!r} of {region_length} bytes",
        )


def _torch_view(tensor: Any) -> tuple[memoryview, int]:
    if tensor.device.type != "cpu":
        raise TransferError("config", f"tensor on {tensor.device}: register it as a region (device "
                                      "memory has no host byte view)")
    return host_view(tensor), tensor.data_ptr()


def as_byte_view(obj: Any) -> tuple[memoryview, int]:
    """A flat writable byte view of ``obj`` and its address.

    Accepts numpy arrays, CPU torch tensors, mmap objects, bytearrays and writable memoryviews;
    arrays must be C-contiguous, tensors dense (contiguous up to a permutation of dims).
    """
    if type(obj).__module__.startswith("torch"):
        return _torch_view(obj)
    try:
        arr = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj
    except (TypeError, ValueError) as exc:
        raise TransferError("config", f"cannot register {type(obj).__name__}: {exc}") from exc
    if not arr.flags.c_contiguous:
        raise TransferError("config", "array is not C-contiguous: register np.ascontiguousarray(a)")
    if not arr.flags.writeable:
        raise TransferError("config", "buffer is read-only: register a writable buffer")
    flat = arr.reshape(-1).view(np.uint8)
    return flat.data.cast("B"), int(flat.ctypes.data)


def _make_region(name: str, obj: Any) -> Region:
    if isinstance(obj, StagedMemory):
        return Region(name=name, view=None, addr=obj.addr, length=obj.length, owner=obj, staged=obj)
    if type(obj).__module__.startswith("torch") and obj.device.type == "cuda":
        from .cuda import CudaMemory

        memory = CudaMemory(obj)
        return Region(name=name, view=None, addr=memory.addr, length=memory.length, owner=obj, staged=memory)
    if type(obj).__module__.startswith("torch") and obj.device.type != "cpu":
        raise TransferError("config", f"tensor on {obj.device}: register CPU or CUDA memory")
    view, addr = as_byte_view(obj)
    return Region(name=name, view=view, addr=addr, length=view.nbytes, owner=obj)


class RegionTable:
    """Thread-safe name -> Region map with bounds-checked lookups."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, obj: Any) -> Region:
        if not isinstance(name, str) or not name:
            raise TransferError("config", "region name must be a non-empty string")
        region = _make_region(name, obj)
        with self._lock:
            if name in self._regions:
                raise TransferError("config", f"region {name!r} already registered; unregister it first")
            self._regions[name] = region
        return region

    def unregister(self, name: str) -> None:
        with self._lock:
            self._regions.pop(name, None)

    def get(self, name: Any) -> Region:
        region = self._regions.get(name) if isinstance(name, str) else None
        if region is None:
            raise TransferError("unknown_region", f"no registered region named {name!r}")
        return region

    def slice(self, name: Any, offset: int, length: int) -> memoryview:
        return self.get(name).slice(offset, length)

    def describe(self) -> dict[str, list[int]]:
        with self._lock:
            return {n: r.describe() for n, r in self._regions.items()}
