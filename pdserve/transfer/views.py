"""Byte views of tensors: a dense tensor's bytes as a flat uint8 tensor on its device, or as a host memoryview.

Used by :mod:`.regions` (registering memory) and :mod:`.cuda` (device memory and its pinned staging buffers); it
imports neither. torch is never imported here: the tensors come from the caller (``byte_tensor`` imports it lazily).
"""

from __future__ import annotations

import ctypes
from typing import Any

from .errors import TransferError


def dense_nbytes(tensor: Any) -> int | None:
    """Bytes spanned by a tensor whose elements tile one gap-free block in some dimension order
    (contiguous, or a permutation of contiguous dims such as vLLM's HND KV view); None otherwise."""
    dims = sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz != 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return None
        expect *= size
    return tensor.numel() * tensor.element_size()


def _dense_or_refuse(tensor: Any) -> int:
    nbytes = dense_nbytes(tensor)
    if nbytes is None:
        raise TransferError("config", "tensor is not contiguous (its elements leave gaps or overlap): register "
                                      "tensor.contiguous(), the base tensor, or its storage")
    return nbytes


def byte_tensor(tensor: Any) -> Any:
    """A flat uint8 tensor over a dense tensor's bytes (same device, same memory, no copy), starting at
    its lowest address: physical order, so offsets are what block tables and strides compute."""
    import torch

    nbytes = _dense_or_refuse(tensor)
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (nbytes,))


def host_view(tensor: Any) -> memoryview:
    """A flat writable memoryview over a dense CPU tensor's bytes (no copy)."""
    nbytes = _dense_or_refuse(tensor)
    addr = tensor.data_ptr()
    raw = (ctypes.c_ubyte * nbytes).from_address(addr) if nbytes else bytearray()
    return memoryview(raw).cast("B")
