"""On-paper planner figures for the docs: KV size and transfer time at 256K tokens for every preset, and where
the recommendation flips from colocated to PD for a dense 70B and a MoE model on H200 + EFA (p5en).

    .venv/bin/python benchmarks/plan_paper.py            # ~2-4 min on 2 cores
    .venv/bin/python benchmarks/plan_paper.py --quick    # fewer grid points

Crossover grid: prompt length x load, where load = offered rate / (workers / unloaded prefill time), i.e. the
fraction of the whole budget's prefill capacity the traffic needs. Targets: TTFT <= max(1 s, 3 x the unloaded
prefill time), TPOT <= 50 ms. Output 256 tokens. Every configuration of the budget is simulated with the
conductor's round-robin baseline (no prefix reuse in this synthetic traffic). Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.plan.cost import HardwareCostModel, min_parallel  # noqa: E402
from pdserve.plan.hardware import accelerator, link, load_catalogue  # noqa: E402
from pdserve.plan.kvsize import load_model, load_presets  # noqa: E402
from pdserve.plan.results import Targets  # noqa: E402
from pdserve.plan.search import candidates, evaluate, rank  # noqa: E402
from pdserve.plan.simulator import SimSettings  # noqa: E402
from pdserve.plan.traffic import LengthMix, poisson  # noqa: E402

CTX = 256 * 1024


def kv_table(acc_name: str, net_name: str) -> list[dict]:
    acc, net = accelerator(acc_name), link(net_name)
    rows = []
    for name in load_presets():
        m = load_model(name)
        par = min_parallel(m, acc, net)
        cost = HardwareCostModel(m, acc, net, par)
        row = {"model": name, "devices": par.devices, "kv_per_token_bf16": m.kv_bytes_per_token("bf16")}
        for dt in ("bf16", "fp8"):
            b = m.kv_bytes(CTX, dt)
            row[f"kv_256k_{dt}_gb"] = b / 1e9
            row[f"xfer_256k_{dt}_ms"] = cost.transfer_s(b) * 1e3  # over the instance's share of the NICs
            row[f"xfer_256k_{dt}_node_ms"] = (b / net.effective_bytes_s(8) + net.overhead_s) * 1e3  # all 8 GPUs' NICs
        row["prefill_256k_s"] = cost.prefill_s(CTX, 0)
        rows.append(row)
    return rows


def crossover(model: str, acc_name: str, net_name: str, budget: int, prompts: list[int], loads: list[float],
              requests: int) -> list[dict]:
    m, acc, net = load_model(model), accelerator(acc_name), link(net_name)
    par = min_parallel(m, acc, net)
    cost = HardwareCostModel(m, acc, net, par, handoff_s=load_catalogue().handoff_s)
    clusters = candidates(budget, par.devices)
    workers = budget // par.devices
    out = []
    for prompt in prompts:
        pf = cost.prefill_s(prompt, 0)
        targets = Targets(max(1.0, 3 * pf), 0.05)
        settings = SimSettings(targets, policy="round_robin", chunk_tokens=8192,
                               kv_capacity_tokens=cost.kv_capacity_tokens())
        for load in loads:
            rate = load * workers / pf
            reqs = poisson(rate, requests, LengthMix.parse(f"{prompt}:256", jitter=0.1), seed=0)
            ranked = rank(evaluate(clusters, cost, settings, reqs))
            best = ranked[0]
            colo = next(r for r in ranked if r["config"].startswith("colocated"))
            pd = next(r for r in ranked if not r["config"].startswith("colocated"))
            out.append({"model": model, "prompt": prompt, "load": load, "rate": round(best["offered_rate"], 3),
                        "ttft_target_s": round(targets.ttft_s, 2), "best": best["config"],
                        "colocated_goodput": colo["goodput_rps"], "best_pd": pd["config"],
                        "pd_goodput": pd["goodput_rps"], "colocated_tpot_p99_ms": (colo["tpot_s"]["p99"] or 0) * 1e3,
                        "pd_tpot_p99_ms": (pd["tpot_s"]["p99"] or 0) * 1e3,
                        "colocated_ttft_p50_s": colo["ttft_s"]["p50"], "pd_ttft_p50_s": pd["ttft_s"]["p50"]})
            r = out[-1]
            print(f"{model:16s} prompt {prompt:6d} load {load:.1f} rate {r['rate']:6.2f}/s  best {r['best']:13s} "
                  f"goodput colo {r['colocated_goodput']:.2f} vs {r['best_pd']} {r['pd_goodput']:.2f}  "
                  f"TPOT p99 colo {r['colocated_tpot_p99_ms']:.0f} ms vs PD {r['pd_tpot_p99_ms']:.0f} ms", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hardware", default="H200")
    ap.add_argument("--network", default="efa-p5en")
    args = ap.parse_args()
    rows = kv_table(args.hardware, args.network)
    print(f"KV cache of one 256K-token request ({CTX} tokens) on {args.hardware} + {args.network}")
    print(f"{'model':16s} {'dev':>3s} {'KiB/tok':>8s} {'bf16 GB':>8s} {'fp8 GB':>7s} {'xfer bf16 ms':>12s} "
          f"{'(8-GPU NICs)':>12s} {'prefill s':>9s}")
    for r in rows:
        print(f"{r['model']:16s} {r['devices']:3d} {r['kv_per_token_bf16'] / 1024:8.1f} {r['kv_256k_bf16_gb']:8.2f} "
              f"{r['kv_256k_fp8_gb']:7.2f} {r['xfer_256k_bf16_ms']:12.0f} {r['xfer_256k_bf16_node_ms']:12.0f} "
              f"{r['prefill_256k_s']:9.1f}")
    prompts = [1000, 4000, 16000] if args.quick else [1000, 2000, 4000, 8000, 16000, 32000]
    loads = [0.3, 0.7] if args.quick else [0.2, 0.5, 0.8]
    n = 150 if args.quick else 300
    cross = crossover("llama-3-70b", args.hardware, args.network, 16, prompts, loads, n)
    cross += crossover("qwen3-235b-a22b", args.hardware, args.network, 64, prompts, loads, n)
    print(json.dumps({"kv_256k": rows, "crossover": cross}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
