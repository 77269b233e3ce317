"""Seeded sampling continued across a migration (issue 41; docs/seeded-sampling.md).

vLLM seeds one random generator per request (``SamplingParams.seed``) and draws from it once per sampled token. A
request that migrates after ``k`` tokens is sent again, as prompt + those tokens, to a fresh worker, whose fresh
generator would give the next token draw 1 where one worker gives it draw ``k + 1``. The router names ``k`` in the
request's ``vllm_xargs`` (``pdserve_rng_skip``; vLLM puts them in ``SamplingParams.extra_args``), and this module,
installed in every vLLM worker process pdserve launches whatever its data plane (vLLM's ``vllm.general_plugins``
entry point, :func:`register`, which vLLM runs in each of its processes: it installs the hook where the launcher
set :data:`ENV`; pdserve's connector installs it too), advances a new request's generator by ``k`` draws the
way that worker's sampler consumes them, before its first sample:

- vLLM's CPU sampler (``TopKTopPSampler.forward_cpu``, fused Gumbel-max): one ``torch.randint(0, 2**31, (1,))`` per
  token;
- the PyTorch-native sampler (``forward_native``; CUDA, ROCm and XPU fall back to it whenever a request has its own
  generator; the CPU sampler with fp64 Gumbel noise): one ``exponential_`` over a row of the vocabulary's width per
  token, in float32 (float64 with fp64 Gumbel noise).

Any other sampler (one this module does not know; speculative decoding's rejection sampler) is not continued: a
warning says so once, and the stream restarts as it did before.

vLLM gives neither a connector nor a logits processor the model runner's generators, so the hook wraps the model
runner's ``_update_states`` (where vLLM builds a new request's generator); ``tests/unit/test_rng_skip.py`` runs
vLLM's own sampler to pin the consumption above, so a vLLM that changes it fails there. The CUDA path is the same
PyTorch call on a CUDA generator; it has not run on a GPU.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger("pdserve.vllm.rng_skip")

SKIP_KEY = "pdserve_rng_skip"
ENV = "PDSERVE_RNG_SKIP"  # "1": the plugin installs the hook (the launcher sets it for every worker it starts)
_INSTALLED = "_pdserve_rng_skip"
_EXPONENTIAL = ("forward_native", "forward_cuda", "forward_hip", "forward_xpu")
_warned: set[str] = set()


def skip_of(sampling_params: Any) -> int:
    """The draws to skip that the router asked for (0: none)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    k = extra.get(SKIP_KEY, 0) if isinstance(extra, dict) else 0
    return k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else 0


def consumption(sampler: Any) -> str:
    """How ``sampler`` (vLLM's ``TopKTopPSampler``) draws from a request's generator per token: "randint" (the CPU
    fused Gumbel-max), "exponential32" / "exponential64" (a row of exponential noise), or "" (not known)."""
    path = getattr(getattr(sampler, "forward", None), "__name__", "")
    fp64 = bool(getattr(sampler, "use_fp64_gumbel", False))
    if path == "forward_cpu":
        return "exponential64" if fp64 else "randint"
    if path in _EXPONENTIAL:
        return "exponential64" if fp64 else "exponential32"
    return ""


def advance(gen: torch.Generator, k: int, how: str, vocab_size: int) -> bool:
    """Draw ``k`` tokens' worth from ``gen`` as a sampler of kind ``how`` (:func:`consumption`) would; False when
    ``how`` is not known (nothing drawn)."""
    if how == "randint":
        for _ in range(k):
            torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)
        return True
    if how in ("exponential32", "exponential64"):
        row = torch.empty(vocab_size, dtype=torch.float64 if how == "exponential64" else torch.float32,
                          device=gen.device)
        for _ in range(k):
            row.exponential_(generator=gen)
        return True
    return False


def skip_new_requests(runner: Any, new_reqs: list[Any]) -> int:
    """Advance the generator of each request in ``new_reqs`` (vLLM's ``NewRequestData``, just added to ``runner``)
    whose sampling params ask for a skip; the number advanced."""
    done = 0
    how = "" if getattr(runner, "speculative_config", None) is not None else \
        consumption(runner.sampler.topk_topp_sampler)
    for data in new_reqs:
        k = skip_of(getattr(data, "sampling_params", None))
        state = runner.requests.get(data.req_id) if k else None
        gen = getattr(state, "generator", None)
        if gen is None:
            continue
        if advance(gen, k, how, int(runner.input_batch.vocab_size)):
            done += 1
        elif how not in _warned:
            _warned.add(how)
            log.warning("seeded request %s: this worker's sampler (%s) is not one pdserve can continue; its random "
                        "stream restarts after the migration", data.req_id, how or "unknown")
    return done


def install() -> bool:
    """Wrap vLLM's model runner so new requests' generators skip the draws the router names (once per process);
    False when vLLM's model runner is not importable here."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # not a vLLM worker process
        return False
    original = GPUModelRunner._update_states
    if getattr(original, _INSTALLED, False):
        return True

    def _update_states(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        new = [r for r in scheduler_output.scheduled_new_reqs
               if r.req_id not in self.requests and skip_of(r.sampling_params)]
        out = original(self, scheduler_output, *args, **kwargs)
        if new:
            skip_new_requests(self, new)
        return out

    setattr(_update_states, _INSTALLED, True)
    GPUModelRunner._update_states = _update_states  # type: ignore[method-assign]
    return True


def register() -> None:
    """vLLM's plugin hook (``vllm.general_plugins``, run in every vLLM process): install the hook in a process the
    pdserve launcher started (:data:`ENV` = "1"), whatever its KV connector (NixlConnector and MooncakeConnector
    workers load no pdserve code otherwise); a plain vLLM process is left as it is."""
    if os.environ.get(ENV) == "1":
        install()
