"""The bytes of a worker's KV cache as the connector addresses them: one flat byte region per layer, whose offsets
are byte offsets from the layer tensor's first element (what the transfer engine registers, what checksums read,
what test faults corrupt)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch


def span_view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 array over raw memory we keep alive elsewhere (the KV cache tensor)."""
    raw = (ctypes.c_ubyte * nbytes).from_address(addr)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)


def byte_region(t: torch.Tensor, span: int) -> Any:
    """The bytes ``[data_ptr, +span)`` of a layer's cache. CPU: a numpy view of the span; CUDA (or any device): a
    flat uint8 tensor over the same storage (the transfer engine takes device tensors)."""
    if t.device.type == "cpu":
        return span_view(t.data_ptr(), span)
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (span,), (1,))


def zero_ranges(memory: dict[str, Any], entries: list[tuple[str, int, str, int, int]]) -> None:
    """Zero the local ranges of transfer ``entries`` (test fault: real corruption of received KV)."""
    for name, off, _, _, n in entries:
        region = memory[name]
        if isinstance(region, np.ndarray):
            region[off:off + n] = 0
        else:
            region[off:off + n].zero_()
