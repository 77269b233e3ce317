"""Which GPUs each worker of a launch gets: a pure rule of the config (no discovery, no environment), so the
config checks a GPU plan when it is built and :mod:`pdserve.launch.plan` applies the same rule.

Discovery (``CUDA_VISIBLE_DEVICES``, ``nvidia-smi -L``) lives in :mod:`pdserve.launch.gpus`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..settings import ConfigError

DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's own default for one instance on a GPU
MIN_MEMORY_UTILIZATION = 0.05  # below this a worker cannot hold weights plus a useful KV cache


@dataclass(frozen=True)
class GpuSlot:
    """What one worker gets: ``devices`` for its ``CUDA_VISIBLE_DEVICES`` (empty: a CPU worker) and its
    ``--gpu-memory-utilization`` (None: vLLM's default, the worker has its GPUs to itself)."""

    devices: tuple[str, ...] = ()
    memory_utilization: float | None = None


def assign_gpus(workers: int, gpus: Sequence[str], per_worker: int = 1, share: bool = False,
                memory_utilization: float | None = None) -> list[GpuSlot]:
    """One :class:`GpuSlot` per worker, in worker order.

    Without ``share`` worker i gets GPUs ``[i*per_worker, (i+1)*per_worker)`` and there must be enough. With
    ``share`` the GPUs form ``len(gpus) // per_worker`` groups, workers go round-robin over them, and each
    worker on a group of k gets ``memory_utilization / k`` (default 0.9 in all). No GPUs: CPU slots.
    """
    if not gpus:
        return [GpuSlot() for _ in range(workers)]
    if per_worker < 1:
        raise ConfigError(f"gpus_per_worker={per_worker}: use 1 or more")
    found = f"{len(gpus)} GPU(s) found ({','.join(gpus)})"
    if per_worker > len(gpus):
        raise ConfigError(f"gpus_per_worker={per_worker} but only {found}; lower --gpus-per-worker")
    if not share:
        need = workers * per_worker
        if need > len(gpus):
            raise ConfigError(
                f"{workers} worker(s) x {per_worker} GPU(s) each need {need} GPUs but only {found}: pass "
                "--share-gpu to put several workers on one GPU (splitting --gpu-memory-utilization), start fewer "
                "workers, or lower --gpus-per-worker")
        return [GpuSlot(tuple(gpus[i * per_worker:(i + 1) * per_worker]), memory_utilization)
                for i in range(workers)]
    groups = [tuple(gpus[g * per_worker:(g + 1) * per_worker]) for g in range(len(gpus) // per_worker)]
    on_group = [sum(1 for i in range(workers) if i % len(groups) == g) for g in range(len(groups))]
    total = DEFAULT_MEMORY_UTILIZATION if memory_utilization is None else memory_utilization
    slots = []
    for i in range(workers):
        g = i % len(groups)
        k = on_group[g]
        util = memory_utilization if k == 1 else _floor3(total / k)
        if util is not None and util < MIN_MEMORY_UTILIZATION:
            raise ConfigError(
                f"--share-gpu puts {k} workers on GPU {','.join(groups[g])} with --gpu-memory-utilization "
                f"{total} in all: {util} each is too little (at least {MIN_MEMORY_UTILIZATION}); start fewer "
                "workers or use more GPUs")
        slots.append(GpuSlot(groups[g], util))
    return slots


def _floor3(x: float) -> float:
    """Round down to 3 decimals, so that the shares of one GPU never add up to more than the total."""
    return int(x * 1000 + 1e-9) / 1000
