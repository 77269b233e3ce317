"""GPUs for the workers of a launch: which ones this host has, and which each worker gets.

    gpus = discover_gpus()                       # CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`; () on CPU
    slots = assign_gpus(3, gpus, per_worker=1, share=True, memory_utilization=0.9)

Discovery reads the environment and runs ``nvidia-smi`` (never imports torch: the launcher stays light and
CUDA-free). Assignment is pure: each worker gets its own GPUs (``CUDA_VISIBLE_DEVICES``), or with ``share``
several workers take turns on the same GPU group and split ``--gpu-memory-utilization`` evenly. No GPU found
means the CPU plan, unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..config import ConfigError

DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's own default for one instance on a GPU
MIN_MEMORY_UTILIZATION = 0.05  # below this a worker cannot hold weights plus a useful KV cache
NVIDIA_SMI_TIMEOUT_S = 15.0

_GPU_LINE = re.compile(r"^GPU (\d+): .*?\(UUID: (GPU-[^)\s]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG .*?Device\s+\d+: \(UUID: (MIG-[^)\s]+)\)")


@dataclass(frozen=True)
class GpuSlot:
    """What one worker gets: ``devices`` for its ``CUDA_VISIBLE_DEVICES`` (empty: a CPU worker) and its
    ``--gpu-memory-utilization`` (None: vLLM's default, the worker has its GPUs to itself)."""

    devices: tuple[str, ...] = ()
    memory_utilization: float | None = None


def parse_visible_devices(value: str) -> tuple[str, ...]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: ids or UUIDs up to the first invalid entry; ``""``/``-1``: none."""
    out: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if not part or part.startswith("-"):
            break  # CUDA ignores this entry and every one after it
        out.append(part)
    return tuple(out)


def parse_nvidia_smi_list(text: str) -> tuple[str, ...]:
    """``nvidia-smi -L`` -> device ids: a GPU's index, or its MIG instances' UUIDs when it is partitioned."""
    out: list[str] = []
    index: str | None = None
    migs: list[str] = []

    def flush() -> None:
        if index is not None:
            out.extend(migs or [index])

    for line in text.splitlines():
        gpu = _GPU_LINE.match(line)
        if gpu:
            flush()
            index, migs = gpu.group(1), []
            continue
        mig = _MIG_LINE.match(line)
        if mig and index is not None:
            migs.append(mig.group(1))
    flush()
    return tuple(out)


def discover_gpus(env: Mapping[str, str] | None = None,
                  run: Callable[[Sequence[str]], str | None] | None = None) -> tuple[str, ...]:
    """The GPUs workers may use: ``CUDA_VISIBLE_DEVICES`` when set (even empty: then none), else every device
    ``nvidia-smi -L`` lists; () when there is no ``nvidia-smi`` or it fails (a CPU host)."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return parse_visible_devices(env["CUDA_VISIBLE_DEVICES"])
    text = (run or _nvidia_smi)(["-L"])
    return parse_nvidia_smi_list(text) if text else ()


def _nvidia_smi(args: Sequence[str]) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


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
