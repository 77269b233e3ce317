"""MLA under TP: does plain vLLM cache the same latent at TP 1 and TP 2? (issue 36, item 2; a diagnostic, no pdserve)

    python benchmarks/mla_tp_latent.py [--out DIR] [--native-rope] [--layers 3]

Builds the tiny random DeepSeek-V3 (``pdserve.launch.models_mla``, fp32), then runs one plain vLLM engine at TP 1 and
one at TP 2 (``--attention-backend CPU_MLA``, ``enforce_eager`` as pdserve's workers; one after the other), each on
one prompt (a 300-token prefix + 5 tokens, greedy, 4 tokens). Inside each worker it records the slots vLLM's CPU MLA
writes and reads those rows back from the KV cache after the run: per rank and layer, the cached latent (kv_c 512 +
k_pe 64) of every token. It prints, per layer: how many prompt rows are bit-identical between TP 1 and each TP 2 rank,
the largest relative difference, and whether both TP 2 ranks hold the same bytes; the generated tokens; and
``rope_kernel``: vLLM's CPU rotary kernel on MLA's strided q view with 4 heads vs 2 (rows that differ).
``--native-rope`` runs the engines with ``compilation_config={"custom_ops": ["-rotary_embedding"]}`` (vLLM's
PyTorch rotary instead of its CPU kernel). Final line: JSON.

The worker-side hooks travel as callables through vLLM's ``collective_rpc``, which needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the engine this script starts (set only in its own child process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

WIDTH = 576  # kv_lora_rank 512 + rope 64


def prompt_ids() -> list[int]:
    rng = random.Random(362)
    prefix = [rng.randrange(1000, 40000) for _ in range(300)]
    return prefix + [rng.randrange(1000, 40000) for _ in range(5)]


def _install(worker: Any) -> bool:
    """In a worker: record the slots each CPU MLA cache write fills, per cache tensor."""
    import builtins

    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    record: dict[int, list[int]] = {}
    original = CPUMLAImpl.do_kv_cache_update

    def hooked(impl: Any, kv_c: Any, k_pe: Any, kv_cache: Any, slot_mapping: Any, *a: Any, **k: Any) -> Any:
        record.setdefault(kv_cache.data_ptr(), []).extend(s for s in slot_mapping.flatten().tolist() if s >= 0)
        return original(impl, kv_c, k_pe, kv_cache, slot_mapping, *a, **k)

    CPUMLAImpl.do_kv_cache_update = hooked
    builtins._mla_tp_latent_slots = record  # type: ignore[attr-defined]
    return True


def _read(worker: Any) -> list[bytes]:
    """In a worker: each layer's cached rows at the recorded slots, as fp32 bytes."""
    import builtins

    record = builtins._mla_tp_latent_slots  # type: ignore[attr-defined]
    out = []
    for t in worker.model_runner.kv_caches:
        slots = record.get(t.data_ptr(), [])
        out.append(t.view(-1, t.shape[-1])[slots].float().numpy().tobytes())
    return out


def engine_run(model: str, tp: int, out: str, native_rope: bool) -> None:
    """Child process: one engine at ``tp``; saves tokens and each rank's latents to ``out`` (.npz)."""
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if native_rope else {}
    llm = LLM(model=model, tensor_parallel_size=tp, dtype="float32", max_model_len=2048, enforce_eager=True,
              attention_backend="CPU_MLA", distributed_executor_backend="mp" if tp > 1 else None, seed=0, **extra)
    llm.collective_rpc(_install)
    res = llm.generate([{"prompt_token_ids": prompt_ids()}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    ranks = llm.collective_rpc(_read)
    arrays = {f"r{r}_l{i}": np.frombuffer(b, dtype=np.float32).reshape(-1, WIDTH)
              for r, layers in enumerate(ranks) for i, b in enumerate(layers)}
    np.savez(out, tokens=np.array(res[0].outputs[0].token_ids), **arrays)


def rope_kernel_rows() -> list[int]:
    """Rows (tokens) where vLLM's CPU rotary kernel gives heads 0-1 of MLA's q view other values with 4 heads than
    with 2 (DeepSeek's call: ``q[..., nope:], k_pe = rope(positions, q[..., nope:], k_pe)``)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=4096, is_neox_style=False, dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        t = len(prompt_ids())
        q_all, kv = torch.randn(t, 4, 96, generator=gen), torch.randn(t, WIDTH, generator=gen)
        outs = []
        for heads in (4, 2):
            q, k = q_all[:, :heads].clone(), kv.clone()
            q[..., 32:], _ = rope.forward_cpu(torch.arange(t), q[..., 32:], k[:, 512:].unsqueeze(1))
            outs.append(q[:, :2])
    diff = (outs[0] - outs[1]).abs().amax(dim=(1, 2))
    return [int(i) for i in torch.nonzero(diff > 0).flatten()]


def compare(tp1: Any, tp2: Any, layers: int, tokens: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(layers):
        a = tp1[f"r0_l{i}"][:tokens]
        row: dict[str, Any] = {"layer": i, "rows": tokens,
                               "tp2_ranks_equal": bool(np.array_equal(tp2[f"r0_l{i}"], tp2[f"r1_l{i}"]))}
        for r in (0, 1):
            b = tp2[f"r{r}_l{i}"][:tokens]
            d = np.abs(a - b).max(axis=1)
            rel = d / np.maximum(np.abs(a).max(axis=1), 1e-30)
            row[f"rank{r}_bit_equal_rows"] = int((d == 0).sum())
            row[f"rank{r}_max_rel"] = float(rel.max())
            row[f"rank{r}_rows_off_1e-3"] = int((rel > 1e-3).sum())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--native-rope", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "TP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        engine_run(args.child[0], int(args.child[1]), args.child[2], args.native_rope)
        return 0
    from pdserve.launch.models_mla import build_random_deepseek_v3

    out = Path(args.out or tempfile.mkdtemp(prefix="mla-tp-latent-"))
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_random_deepseek_v3(out / "dsv3", layers=args.layers))
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    for tp, bind in ((1, "0"), (2, "0|1")):  # vLLM's CPU workers need one core list per rank
        cmd = [sys.executable, __file__, "--child", model, str(tp), str(out / f"tp{tp}.npz")]
        cmd += ["--native-rope"] if args.native_rope else []
        with open(out / f"tp{tp}.log", "w") as log:
            subprocess.run(cmd, env={**env, "VLLM_CPU_OMP_THREADS_BIND": env.get("PDSERVE_BIND_" + str(tp), bind)},
                           stdout=log, stderr=subprocess.STDOUT, check=True, timeout=900)
    tp1, tp2 = np.load(out / "tp1.npz"), np.load(out / "tp2.npz")
    rows = compare(tp1, tp2, args.layers, len(prompt_ids()))
    print(f"{'layer':>5} {'bit-equal rows r0/r1':>22} {'max rel r0':>11} {'rows off >1e-3':>15} "
          f"{'TP2 ranks equal':>16}")
    for r in rows:
        print(f"{r['layer']:>5} {r['rank0_bit_equal_rows']:>10}/{r['rank1_bit_equal_rows']:<4} of {r['rows']:<4}"
              f" {r['rank0_max_rel']:>11.3g} {r['rank0_rows_off_1e-3']:>15} {str(r['tp2_ranks_equal']):>16}")
    kernel = rope_kernel_rows()
    result = {"native_rope": args.native_rope, "tokens_tp1": tp1["tokens"].tolist(),
              "tokens_tp2": tp2["tokens"].tolist(), "layers": rows,
              "rope_kernel_rows_4_vs_2_heads": [len(kernel), kernel[:1], kernel[-1:]], "out": str(out)}
    print(f"tokens TP 1 {result['tokens_tp1']}, TP 2 {result['tokens_tp2']}; CPU rotary kernel, 4 vs 2 heads: "
          f"{len(kernel)} rows differ ({kernel[:1]}..{kernel[-1:]})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
