"""CUDA memory for the transfer engine: staging copier, and CUDA IPC between processes of one host.

Nothing here runs without a CUDA device; the pipeline that drives :class:`CudaCopier` is
:mod:`pdserve.transfer.staging`, exercised on CPU with a host copier. torch is imported lazily so that a
CPU-only deployment never needs CUDA libraries.

CUDA IPC: the owner exports each CUDA region's storage with ``UntypedStorage._share_cuda_()`` (device,
handles as bytes, sizes and offsets as ints: msgpack-able, never pickled); a same-host initiator opens it
once with ``UntypedStorage._new_shared_cuda`` and keeps it, then every transfer is a device-to-device
``copy_`` in the initiator's process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from .errors import TransferError
from .staging import Copier, Piece, StagedMemory
from .views import byte_tensor, host_view

_POLL_S = 20e-6


class CudaMemory(StagedMemory):
    """A registered CUDA tensor: its dense byte span, as a flat uint8 tensor on its device."""

    kind = "cuda"

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor  # keeps the memory alive
        self.flat = byte_tensor(tensor)
        index = tensor.device.index
        self.device = int(index if index is not None else 0)
        self.addr = int(self.flat.data_ptr())
        self.length = int(self.flat.numel())

    def new_copier(self, chunk_bytes: int, buffers: int) -> CudaCopier:
        return CudaCopier(self.device, chunk_bytes, buffers)


class CudaCopier(Copier):
    """Pinned host buffers, one CUDA stream, one event per buffer; ``non_blocking`` copies."""

    def __init__(self, device: int, chunk_bytes: int, buffers: int = 2) -> None:
        import torch

        self._torch = torch
        self._device = torch.device("cuda", device)
        try:
            self._host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
            self._stream = torch.cuda.Stream(device=self._device)
        except RuntimeError as exc:
            raise TransferError("device", f"cannot set up staging for {self._device}: {exc}") from exc
        super().__init__([host_view(t) for t in self._host])
        self._events: list[Any] = [None] * buffers

    def _enqueue(self, j: int, pieces: Sequence[Piece], to_device: bool) -> None:
        torch = self._torch
        try:
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                if not to_device:  # bytes written by work queued on the default stream come first
                    self._stream.wait_stream(torch.cuda.default_stream(self._device))
                pos = 0
                for mem, offset, length in pieces:
                    host = self._host[j][pos : pos + length]
                    dev = mem.flat[offset : offset + length]  # type: ignore[attr-defined]
                    if to_device:
                        dev.copy_(host, non_blocking=True)
                    else:
                        host.copy_(dev, non_blocking=True)
                    pos += length
                event = torch.cuda.Event()
                event.record(self._stream)
        except RuntimeError as exc:
            raise TransferError("device", f"staging copy on {self._device} failed: {exc}") from exc
        self._events[j] = event

    def to_host(self, j: int, pieces: Sequence[Piece]) -> None:
        self._enqueue(j, pieces, False)

    def to_device(self, j: int, pieces: Sequence[Piece]) -> None:
        self._enqueue(j, pieces, True)

    def wait(self, j: int, timeout: float) -> None:
        event = self._events[j]
        if event is None:
            return
        limit = time.monotonic() + timeout
        try:
            while not event.query():
                if time.monotonic() > limit:
                    raise TransferError("deadline", f"staging copy on {self._device} past the deadline")
                time.sleep(_POLL_S)
        except RuntimeError as exc:
            raise TransferError("device", f"staging copy on {self._device} failed: {exc}") from exc
        self._events[j] = None

    def close(self) -> None:
        try:
            self._stream.synchronize()  # no copy may still target the buffers we drop
        except RuntimeError:
            pass


# ---- CUDA IPC (same host) ----

def export_ipc(memory: CudaMemory) -> list[Any]:
    """The msgpack-able record a same-host peer needs to open ``memory``: the storage's IPC handle fields,
    then the region's byte offset inside that storage."""
    tensor = memory.tensor
    fields = tensor.untyped_storage()._share_cuda_()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
    return [int(device), bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset),
            bytes(event_handle), bool(event_sync), int(tensor.storage_offset() * tensor.element_size())]


def _open_ipc(record: list[Any], length: int) -> Any:
    import torch

    if not isinstance(record, list) or len(record) != 9:
        raise TransferError("protocol", "malformed CUDA IPC record")
    *fields, region_offset = record
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", int(fields[0])))
    return flat.set_(storage, int(region_offset), (int(length),))


class IpcCache:
    """Peer CUDA regions opened through IPC, once per (peer engine, region, handle)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str, bytes], Any] = {}
        self._lock = threading.Lock()

    def get(self, engine_id: str, region: str, record: list[Any], length: int) -> Any:
        key = (engine_id, region, bytes(record[1]) if isinstance(record, list) and len(record) > 1 else b"")
        with self._lock:
            flat = self._open.get(key)
            if flat is None:
                try:
                    flat = self._open[key] = _open_ipc(record, length)
                except RuntimeError as exc:
                    raise TransferError("unavailable", f"cannot open peer CUDA memory {region!r}: {exc}") from exc
            return flat

    def clear(self) -> None:
        with self._lock:
            self._open.clear()


_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def _stream(device: int) -> Any:
    import torch

    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=torch.device("cuda", device))
        return stream


def device_copy(pairs: Sequence[tuple[Any, Any]], device: int, remaining: Any) -> None:
    """``dst.copy_(src)`` for each (dst, src) pair of flat CUDA byte tensors, queued on one stream of
    ``device`` after the work already on its default stream; returns when all are done. ``remaining()``
    bounds the wait (it raises once the batch ended or is overdue)."""
    import torch

    stream = _stream(device)
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.default_stream(device))
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        while not event.query():
            if remaining() <= 0:
                raise TransferError("deadline", "device copy past the deadline")
            time.sleep(_POLL_S)
    except RuntimeError as exc:
        raise TransferError("device", f"device-to-device copy on cuda:{device} failed: {exc}") from exc
