"""A discarded sample's draw rewound on a CPU generator (issue 41; docs/seeded-sampling.md).

When a step computes only part of a request's prompt (chunked prefill), vLLM 0.32 still samples for it and then
discards the token, and gives the request's seeded generator its draw back: ``gen.set_offset(gen.get_offset() - 4)``
(``GPUModelRunner._bookkeeping_sync``), the Philox arithmetic of a CUDA generator. A CPU generator (mt19937) has no
offset: ``RuntimeError: CPU Generator does not use offset``, raised in the engine core, which dies. So on a plain
vLLM CPU worker a seeded request whose prompt is prefilled in chunks (a prompt over ``--max-num-batched-tokens``,
or one that shares a step's token budget with others) kills the worker, and each worker it is sent to after.

Here the same rewind is made by state: before the step samples, the generator of each request whose sample will be
discarded is snapshot (``get_state``, 5,056 bytes); before vLLM's rewind, it is restored and the request's generator
is out of vLLM's map for the length of that call, so vLLM's ``set_offset`` is not reached; then it is put back. The
generator ends where it was before the discarded draw, exactly as vLLM's rewind leaves a CUDA generator. Only CPU
generators are touched; installed in every worker pdserve launches (vLLM's plugin entry point, with
:mod:`.rng_skip`) and by pdserve's connector.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .rng_skip import ENV  # the launcher's switch for pdserve's seeded-sampling hooks

log = logging.getLogger("pdserve.vllm.cpu_rewind")

_INSTALLED = "_pdserve_cpu_rewind"
_SNAPSHOTS = "_pdserve_rewind_states"


def discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """The CPU generators of the requests whose sample this step discards (a partial prefill), by batch index."""
    batch = runner.input_batch
    mask = runner.discard_request_mask.np[:batch.num_reqs]
    out = {}
    for i in mask.nonzero()[0]:
        gen = batch.generators.get(int(i))
        if gen is not None and gen.device.type == "cpu":
            out[int(i)] = gen
    return out


def snapshot(runner: Any) -> None:
    """Before the step samples: keep the state of each generator whose draw will be discarded."""
    setattr(runner, _SNAPSHOTS, {i: (gen, gen.get_state()) for i, gen in discarded_cpu_generators(runner).items()})


def rewind(runner: Any) -> dict[int, Any]:
    """Before vLLM's rewind: give each snapshot generator its state back and take it out of the batch's map (vLLM
    then does not call ``set_offset`` on it); returns what was taken out, for :func:`put_back`."""
    states = getattr(runner, _SNAPSHOTS, None) or {}
    setattr(runner, _SNAPSHOTS, {})
    generators = runner.input_batch.generators
    taken = {}
    for i, (gen, state) in states.items():
        if generators.get(i) is gen:
            gen.set_state(state)
            taken[i] = generators.pop(i)
    return taken


def put_back(runner: Any, taken: dict[int, Any]) -> None:
    runner.input_batch.generators.update(taken)


def install() -> bool:
    """Wrap vLLM's model runner's ``_sample`` and ``_bookkeeping_sync`` (once per process); False when vLLM's
    model runner is not importable here."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # not a vLLM worker process
        return False
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync
    if getattr(sample, _INSTALLED, False):
        return True

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        snapshot(self)
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        taken = rewind(self)
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            put_back(self, taken)

    setattr(_sample, _INSTALLED, True)
    GPUModelRunner._sample = _sample  # type: ignore[method-assign]
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync  # type: ignore[method-assign]
    return True


def register() -> None:
    """vLLM's plugin hook (``vllm.general_plugins``): install in a process the pdserve launcher started."""
    if os.environ.get(ENV) == "1":
        install()
