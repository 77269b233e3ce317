"""pdserve/vllm/cpu_rewind.py: a discarded sample's draw given back to a CPU generator by state, where vLLM 0.32's
own rewind (``set_offset``) raises on CPU."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.vllm import cpu_rewind, rng_skip


def _runner(discard: list[bool], generators: dict[int, torch.Generator]) -> SimpleNamespace:
    return SimpleNamespace(input_batch=SimpleNamespace(num_reqs=len(discard), generators=generators),
                           discard_request_mask=SimpleNamespace(np=np.array(discard + [False] * 4)))


def _draw(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**31, (1,), generator=gen))  # vLLM's CPU sampler: one draw per step


def test_vllms_own_rewind_fails_on_a_cpu_generator():
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        gen.set_offset(gen.get_offset() - 4)


def test_a_discarded_draw_is_given_back_and_the_stream_goes_on():
    partial, done = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    generators = {0: partial, 1: done}
    runner = _runner([True, False], generators)
    cpu_rewind.snapshot(runner)
    _draw(partial), _draw(done)  # the step samples both; request 0's token is discarded
    taken = cpu_rewind.rewind(runner)
    assert taken == {0: partial} and generators == {1: done}  # vLLM's rewind loop finds no generator to offset
    cpu_rewind.put_back(runner, taken)
    assert generators == {0: partial, 1: done}
    one_go, other = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    assert [_draw(partial) for _ in range(3)] == [_draw(one_go) for _ in range(3)]  # as if never drawn
    _draw(other)
    assert _draw(done) == _draw(other)  # the kept sample's draw stays drawn


def test_nothing_discarded_nothing_touched():
    gen = torch.Generator().manual_seed(5)
    runner = _runner([False], {0: gen})
    cpu_rewind.snapshot(runner)
    _draw(gen)
    assert cpu_rewind.rewind(runner) == {} and runner.input_batch.generators == {0: gen}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_install_wraps_the_model_runner_once_and_the_plugin_asks_the_launchers_switch(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    before = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync
    try:
        monkeypatch.delenv(rng_skip.ENV, raising=False)
        cpu_rewind.register()
        assert (GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync) == before
        monkeypatch.setenv(rng_skip.ENV, "1")
        cpu_rewind.register()
        wrapped = GPUModelRunner._sample
        assert getattr(wrapped, "_pdserve_cpu_rewind", False) and cpu_rewind.install()
        assert GPUModelRunner._sample is wrapped
    finally:
        GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync = before
