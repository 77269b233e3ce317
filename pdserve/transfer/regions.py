"""Registered memory regions: the only bytes a peer may read or write."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import TransferError


@dataclass(frozen=True)
class Region:
    """A named, registered, writable byte range of this process."""

    name: str
    view: memoryview  # flat, format "B", writable
    addr: int
    length: int
    owner: Any  # keeps the underlying buffer alive

    def slice(self, offset: int, length: int) -> memoryview:
        check_range(self.name, self.length, offset, length)
        return self.view[offset : offset + length]


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
        raise TransferError("config", f"tensor on {tensor.device}: the CPU backends register CPU tensors only")
    if not tensor.is_contiguous():
        raise TransferError("config", "tensor is not contiguous: register tensor.contiguous() or its storage")
    nbytes = tensor.numel() * tensor.element_size()
    addr = tensor.data_ptr()
    raw = (ctypes.c_ubyte * nbytes).from_address(addr) if nbytes else bytearray()
    return memoryview(raw).cast("B"), addr


def as_byte_view(obj: Any) -> tuple[memoryview, int]:
    """A flat writable byte view of ``obj`` and its address.

    Accepts numpy arrays, CPU torch tensors, mmap objects, bytearrays and writable memoryviews;
    all must be C-contiguous.
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
    return memoryview(flat).cast("B"), int(flat.ctypes.data)


class RegionTable:
    """Thread-safe name -> Region map with bounds-checked lookups."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, obj: Any) -> Region:
        if not isinstance(name, str) or not name:
            raise TransferError("config", "region name must be a non-empty string")
        view, addr = as_byte_view(obj)
        region = Region(name=name, view=view, addr=addr, length=view.nbytes, owner=obj)
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
            return {n: [r.addr, r.length] for n, r in self._regions.items()}
