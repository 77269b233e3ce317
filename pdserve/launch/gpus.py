"""GPUs for the workers of a launch: which ones this host has, and which each worker gets.

    gpus = discover_gpus()                       # CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`; () on CPU
    slots = assign_gpus(3, gpus, per_worker=1, share=True, memory_utilization=0.9)

Discovery reads the environment and runs ``nvidia-smi`` (never imports torch: the launcher stays light and
CUDA-free). Assignment (:mod:`pdserve.launch.config_gpus`, re-exported here) is pure: each worker gets its own GPUs
(``CUDA_VISIBLE_DEVICES``), or with ``share`` several workers take turns on the same GPU group and split
``--gpu-memory-utilization`` evenly. No GPU found means the CPU plan, unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from .config_gpus import (  # noqa: F401  (re-exported: assignment is a config rule, checked when a config is built)
    DEFAULT_MEMORY_UTILIZATION,
    MIN_MEMORY_UTILIZATION,
    GpuSlot,
    assign_gpus,
)

NVIDIA_SMI_TIMEOUT_S = 15.0

_GPU_LINE = re.compile(r"^GPU (\d+): .*?\(UUID: (GPU-[^)\s]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG .*?Device\s+\d+: \(UUID: (MIG-[^)\s]+)\)")


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
