"""'This machine' as the planner measures it: real matmuls, copies and transfer-engine loopback reads.

The assertions are about behaviour, not this machine's speed (a CPU without bf16 units does ~1 GFLOP/s): every
rate is positive and finite, and in per-second units, checked against the wall clock of the same operation."""

import math
import os
import time

import numpy as np
import pytest

from pdserve.plan.measure import measure_machine

pytestmark = pytest.mark.integration


def _wall_s(fn, reps: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _same_order(predicted_s: float, measured_s: float) -> bool:
    """Within 50x either way: loose enough for a busy machine, tight enough to catch ms vs s or bits vs bytes."""
    return predicted_s / 50 < measured_s < predicted_s * 50


def test_measures_this_machine_in_seconds():
    m = measure_machine()
    for name in ("matmul_flops", "copy_bytes_s", "transfer_bytes_s", "memory_bytes"):
        v = getattr(m, name)
        assert isinstance(v, float) and math.isfinite(v) and v > 0, (name, v)
    assert m.cores == len(os.sched_getaffinity(0))
    # units: the rates predict how long the same operations take by the wall clock
    import torch

    n = 512
    dt = getattr(torch, m.dtype)  # the CPU rule's dtype (pdserve.dtype), as the measurement used
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    assert _same_order(2.0 * n ** 3 / m.matmul_flops, _wall_s(lambda: a @ b)), m
    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    assert _same_order(src.nbytes / m.copy_bytes_s, _wall_s(lambda: np.copyto(dst, src))), m
    acc, net = m.accelerator(), m.link()
    assert acc.bf16_flops == m.matmul_flops and net.effective_bytes_s(1) == m.transfer_bytes_s
