"""Seeded sampling continued across a migration (pdserve/vllm/rng_skip.py): a fresh generator advanced by k draws
gives the token vLLM's own sampler gives as its (k + 1)-th, for each way vLLM's samplers consume a request's
generator. Runs vLLM's TopKTopPSampler, so a vLLM that changes its consumption fails here."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from pdserve.vllm import rng_skip

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
VOCAB = 257


def _sampler(path: str, fp64: bool = False):
    import vllm._custom_ops  # noqa: F401  (registers vLLM's CPU kernels: the fused Gumbel-max forward_cpu runs)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    s = TopKTopPSampler(use_fp64_gumbel=fp64)
    s.forward = getattr(s, path)
    return s


def _draws(sampler, seed: int, n: int, logits: torch.Tensor, skip: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if skip:
        assert rng_skip.advance(gen, skip, rng_skip.consumption(sampler), VOCAB)
    out = []
    for _ in range(n):
        token, _ = sampler.forward(logits.clone(), {0: gen}, None, None)
        out.append(int(token[0]))
    return out


@pytest.mark.parametrize("path,fp64,how", [("forward_cpu", False, "randint"), ("forward_cpu", True, "exponential64"),
                                           ("forward_native", False, "exponential32"),
                                           ("forward_native", True, "exponential64")])
def test_a_skipped_stream_continues_where_one_worker_is(path, fp64, how):
    sampler = _sampler(path, fp64)
    assert rng_skip.consumption(sampler) == how
    logits = torch.zeros(1, VOCAB)  # flat: every draw decides the token, so a shifted stream shows
    whole = _draws(sampler, 1234, 12, logits)
    assert len(set(whole)) > 3
    for k in (1, 5, 11):
        assert _draws(sampler, 1234, 12 - k, logits, skip=k) == whole[k:], (path, k)
    assert _draws(sampler, 1234, 11, logits) != whole[1:]  # unskipped, the stream restarts (the old behaviour)


def test_skip_only_where_asked_and_known():
    assert rng_skip.skip_of(SimpleNamespace(extra_args={"pdserve_rng_skip": 3})) == 3
    for extra in (None, {}, {"pdserve_rng_skip": 0}, {"pdserve_rng_skip": True}, {"pdserve_rng_skip": "3"}):
        assert rng_skip.skip_of(SimpleNamespace(extra_args=extra)) == 0
    assert rng_skip.consumption(SimpleNamespace(forward=SimpleNamespace(__name__="forward_tpu"))) == ""
    assert not rng_skip.advance(torch.Generator(), 2, "", VOCAB)


def test_new_requests_get_their_skip():
    sampler = _sampler("forward_cpu")
    gens = {r: torch.Generator().manual_seed(7) for r in ("a", "b")}
    runner = SimpleNamespace(requests={r: SimpleNamespace(generator=g) for r, g in gens.items()},
                             speculative_config=None, sampler=SimpleNamespace(topk_topp_sampler=sampler),
                             input_batch=SimpleNamespace(vocab_size=VOCAB))
    new = [SimpleNamespace(req_id="a", sampling_params=SimpleNamespace(extra_args={"pdserve_rng_skip": 2})),
           SimpleNamespace(req_id="b", sampling_params=SimpleNamespace(extra_args=None))]
    assert rng_skip.skip_new_requests(runner, new) == 1
    ref = torch.Generator().manual_seed(7)
    rng_skip.advance(ref, 2, "randint", VOCAB)
    assert torch.equal(gens["a"].get_state(), ref.get_state())
    assert torch.equal(gens["b"].get_state(), torch.Generator().manual_seed(7).get_state())
    runner.speculative_config = object()  # speculative decoding's rejection sampler: not continued
    assert rng_skip.skip_new_requests(runner, new) == 0


def test_install_wraps_the_model_runner_once():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    before = GPUModelRunner._update_states
    try:
        assert rng_skip.install() and rng_skip.install()
        wrapped = GPUModelRunner._update_states
        assert getattr(wrapped, "_pdserve_rng_skip", False)
        assert rng_skip.install() and GPUModelRunner._update_states is wrapped
    finally:
        GPUModelRunner._update_states = before


def test_the_router_and_the_worker_name_the_skip_alike():
    from pdserve.router.run.generation import RNG_SKIP_KEY

    assert RNG_SKIP_KEY == rng_skip.SKIP_KEY


@pytest.mark.parametrize("plane", ["pdserve", "nixl", "mooncake"])
def test_every_launched_worker_asks_the_plugin_for_the_hook(plane):
    from pdserve.launch.commands import RNG_SKIP_ENV, worker_env
    from pdserve.launch.config import WorkerConfig

    w = WorkerConfig(role="decode", index=0, model="/m", port=8100, cores=(0,), kv_connector=plane,
                     mooncake_bootstrap_port=8998 if plane == "mooncake" else 0,
                     nixl_side_channel_port=8997 if plane == "nixl" else 0)
    assert RNG_SKIP_ENV == rng_skip.ENV and worker_env(w)[rng_skip.ENV] == "1"


def test_the_plugin_installs_only_where_the_launcher_asked(monkeypatch):
    from importlib.metadata import entry_points

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("pdserve_rng_skip") == "pdserve.vllm.rng_skip:register"  # pyproject.toml (setup.sh installs)
    before = GPUModelRunner._update_states
    try:
        monkeypatch.delenv(rng_skip.ENV, raising=False)
        rng_skip.register()  # a plain vLLM process: untouched
        assert GPUModelRunner._update_states is before
        monkeypatch.setenv(rng_skip.ENV, "1")
        rng_skip.register()
        assert getattr(GPUModelRunner._update_states, "_pdserve_rng_skip", False)
    finally:
        GPUModelRunner._update_states = before
