"""Expert parallelism and data-parallel attention per worker pool (issue 36, item 3): which prefill and decode
workers run vLLM's ``--enable-expert-parallel`` and ``--data-parallel-size``, and the checks of those settings.

A wide-EP decode pool: ``--decode-dp D --decode-ep`` (with ``--decode-tp T``) makes each decode worker one vLLM
server of D data-parallel attention ranks (each its own engine, scheduler and KV cache, T GPUs each) whose routed
experts are spread over all T x D ranks. Data parallelism needs GPU workers here: on CPU vLLM binds OpenMP threads
per tensor-parallel rank only, and it was not run. Expert parallelism needs GPU workers too: vLLM 0.32's CPU MoE
experts (``CPUUnquantizedExperts.apply``, vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) ignore the
``expert_map`` expert parallelism builds and index each rank's half of the experts with global expert ids, so a
plain vLLM CPU worker with ``--tensor-parallel-size 2 --enable-expert-parallel`` segfaults in its first forward
(``cpu_fused_moe.cpp:242``, ``fused_moe_impl<float>``; a tiny Qwen3-MoE in fp32, with or without pdserve's
connector: benchmarks/ep_exactness.py), or reads other memory as weights where it does not crash. TP alone runs.
"""

from __future__ import annotations

from ..settings import ConfigError
from .config_shapes import LaunchShape


def worker_ep(cfg: LaunchShape, role: str) -> bool:
    """Whether a worker of ``role`` runs its routed experts expert-parallel."""
    return {"prefill": cfg.prefill_ep, "decode": cfg.decode_ep}.get(role, False)


def worker_dp(cfg: LaunchShape, role: str) -> int:
    """Data-parallel attention ranks of a worker of ``role`` (vLLM's --data-parallel-size; 1: none)."""
    return {"prefill": cfg.prefill_dp, "decode": cfg.decode_dp}.get(role, 1)


def worker_ranks(cfg: LaunchShape, role: str) -> int:
    """vLLM ranks of one worker of ``role``: tensor-parallel x data-parallel."""
    tp = {"prefill": cfg.prefill_tp, "decode": cfg.decode_tp}.get(role, 1)
    return tp * worker_dp(cfg, role)


def check_experts(cfg: LaunchShape) -> None:
    """prefill/decode ep and dp: fixed roles only; data parallelism on GPU workers, without the KV pool, and not
    with the conductor's prefix index (vLLM spreads a worker's requests over its DP ranks itself)."""
    moe = {"prefill_ep": cfg.prefill_ep, "decode_ep": cfg.decode_ep, "prefill_dp": cfg.prefill_dp > 1,
           "decode_dp": cfg.decode_dp > 1}
    given = [name for name, on in moe.items() if on]
    if given and (cfg.colocated or cfg.elastic):
        raise ConfigError(f"{', '.join(given)} apply to prefill and decode workers: for colocated workers pass "
                          "--worker-args '--enable-expert-parallel --data-parallel-size N'")
    ep = [name for name in ("prefill_ep", "decode_ep") if moe[name]]
    if ep and not cfg.gpus:
        raise ConfigError(f"{', '.join(ep)} on CPU workers: vLLM 0.32's CPU MoE kernel ignores expert parallelism's "
                          "expert map (CPUUnquantizedExperts.apply in vllm/model_executor/layers/fused_moe/experts/"
                          "cpu_moe.py), so a CPU worker with --enable-expert-parallel segfaults in its first forward "
                          "(cpu_fused_moe.cpp:242) or computes with the wrong experts; drop --prefill-ep/--decode-ep "
                          "on CPU (--decode-tp N alone shards the experts' weights over the TP ranks), or use GPU "
                          "workers (--gpus)")
    dp = max(cfg.prefill_dp, cfg.decode_dp)
    if dp == 1:
        return
    if not cfg.gpus:
        raise ConfigError(f"prefill_dp={cfg.prefill_dp}, decode_dp={cfg.decode_dp} on CPU workers: data-parallel "
                          "attention runs one vLLM engine per DP rank on GPUs of its own; this launcher plans it for "
                          "GPU workers only (vLLM's CPU backend binds threads per tensor-parallel rank, and DP was "
                          "not run on CPU); drop --prefill-dp/--decode-dp, or use --decode-tp N --decode-ep on CPU")
    if cfg.pool:
        raise ConfigError(f"prefill_dp={cfg.prefill_dp}, decode_dp={cfg.decode_dp} with the KV pool: the pool "
                          "serves single-engine TP=1 workers only; add --no-pool")
    if cfg.policy == "conductor":
        raise ConfigError(f"prefill_dp={cfg.prefill_dp}, decode_dp={cfg.decode_dp} with --policy conductor: vLLM "
                          "spreads a worker's requests over its DP ranks itself, so the conductor's prefix index "
                          "cannot know which rank holds a prefix; use --policy least_loaded or round_robin")
