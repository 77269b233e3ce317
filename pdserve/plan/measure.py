"""Measure this machine in a few seconds: matmul rate in the dtype the workers run in (the CPU rule of
:mod:`pdserve.dtype`, as ``pdserve serve`` picks it), memory copy bandwidth, transfer-engine loopback."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdserve.dtype import DtypeChoice, choose_dtype

from .hardware import Accelerator, Link


@dataclass(frozen=True)
class MachineMeasurement:
    matmul_flops: float  # FLOP/s in ``dtype`` on the cores this process may use
    copy_bytes_s: float  # memcpy bandwidth (bytes copied per second)
    transfer_bytes_s: float  # pdserve transfer engine, same-host loopback
    cores: int
    memory_bytes: float
    dtype: str = "bfloat16"  # the matmul's dtype: the CPU rule's unless overridden
    dtype_reason: str = ""

    def accelerator(self, mfu: float = 1.0, mbu: float = 1.0, step_overhead_s: float = 0.02) -> Accelerator:
        """This machine as an Accelerator; measured rates are already achieved rates (mfu = mbu = 1)."""
        return Accelerator("this", self.matmul_flops, None, self.copy_bytes_s, self.memory_bytes,
                           mfu, mbu, step_overhead_s)

    def link(self, overhead_s: float = 0.002) -> Link:
        return Link("this-loopback", self.transfer_bytes_s, 1, 1.0, overhead_s)


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(n: int = 1024, reps: int = 3, dtype: str = "bfloat16") -> float:
    """n x n matmul rate with torch in ``dtype`` (``bfloat16`` or ``float32``)."""
    import torch

    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, dtype=getattr(torch, dtype))
    return 2.0 * n ** 3 / _best_seconds(lambda: a @ b, reps)


def copy_bytes_s(nbytes: int = 256 << 20, reps: int = 3) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / _best_seconds(lambda: np.copyto(dst, src), reps)


def transfer_bytes_s(nbytes: int = 64 << 20, reps: int = 3) -> float:
    """Loopback bandwidth of pdserve's transfer engine between two engines of this process."""
    from pdserve.transfer import TransferConfig, TransferEngine

    secret = "pdserve-plan-measure-" + os.urandom(8).hex()
    with TransferEngine(TransferConfig(secret=secret)) as owner, TransferEngine(TransferConfig(secret=secret)) as me:
        owner.register("kv", np.ones(nbytes, dtype=np.uint8))
        me.register("kv", np.empty(nbytes, dtype=np.uint8))
        peer = owner.segment()
        return nbytes / _best_seconds(lambda: me.read(peer, [("kv", 0, "kv", 0, nbytes)]), reps)


def _memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_machine(dtype: str | None = None) -> MachineMeasurement:
    """All three measurements (about 2-5 s on 2 cores); the matmul in ``dtype``, default the CPU rule's
    (:func:`pdserve.dtype.choose_dtype`: the dtype ``pdserve serve`` runs the workers in)."""
    choice: DtypeChoice = choose_dtype(dtype)
    return MachineMeasurement(matmul_flops=matmul_flops(dtype=choice.dtype), copy_bytes_s=copy_bytes_s(),
                              transfer_bytes_s=transfer_bytes_s(), cores=len(os.sched_getaffinity(0)),
                              memory_bytes=_memory_bytes(), dtype=choice.dtype, dtype_reason=choice.reason)
