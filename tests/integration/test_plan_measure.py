"""'This machine' as the planner measures it: real matmuls, copies and transfer-engine loopback reads."""

import pytest

from pdserve.plan.measure import measure_machine

pytestmark = pytest.mark.integration


def test_measures_this_machine_in_seconds():
    m = measure_machine()
    assert 1e9 < m.matmul_flops < 1e14  # a CPU's bf16 rate: GFLOP/s to tens of TFLOP/s
    assert 1e8 < m.copy_bytes_s < 1e12
    assert 1e7 < m.transfer_bytes_s < 1e12
    acc, net = m.accelerator(), m.link()
    assert acc.bf16_flops == m.matmul_flops and net.effective_bytes_s(1) == m.transfer_bytes_s
