"""Conductor benchmarks.

    python benchmarks/conductor_bench.py decision [--blocks 100000] [--workers 8 64]
        Placement decision time (p50, p99) with N workers and 100k indexed blocks: the conductor alone, and the
        router's whole choice (block hashing of the prompt's token ids + placement). Baseline in the same run:
        round-robin placement.
    python benchmarks/conductor_bench.py sim [--workers 64] [--requests 600] [--rate 30]
        64 simulated workers (pdserve.plan's simulator, the conductor's own cost model) replaying a slice of the
        Mooncake conversation trace: prefix hit rate and TTFT, conductor vs round-robin vs least-loaded.
    python benchmarks/conductor_bench.py live [--requests 60] ...
        A real 2P1D vLLM run (pdserve serve, SmolLM2) replaying a scaled slice of the trace, conductor vs
        round-robin in turn: prefix hit rate (vLLM's counters), TTFT mean/p99.

Each prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel, PlacementRequest  # noqa: E402
from pdserve.conductor.cost_model import Priors  # noqa: E402
from pdserve.hashing import block_hashes  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
BS = 128


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def gpu_like_cost() -> OnlineCostModel:
    """An 8B-class model on one modern GPU: ~60 us/token prefill, 15 ms decode steps, 25 GB/s links."""
    return OnlineCostModel(131072, Priors(prefill=(0.02, 6e-5, 2e-10), decode=(0.015, 2e-4, 2e-8),
                                          bandwidth_bytes_s=25e9, transfer_overhead_s=0.001, handoff_s=0.005))


# ---------------------------------------------------------------- decision time
def decision(n_workers: int, n_blocks: int, policy: str, n_requests: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    c = Conductor(ConductorConfig(policy=policy, block_size=BS), gpu_like_cost())
    n_p = n_workers // 2
    for i in range(n_p):
        c.add_worker(f"p{i}", "prefill", 1 << 20)
    for i in range(n_workers - n_p):
        c.add_worker(f"d{i}", "decode", 1 << 20)
    # conversations: 64-block (8K-token) prompts; each cached on 1-3 workers, until n_blocks keys are indexed
    import numpy as np

    nprng = np.random.default_rng(seed)
    convs: list[list[int]] = []
    while len(c.index) < n_blocks:
        toks = nprng.integers(0, 32000, 64 * BS).tolist()
        keys = block_hashes(toks, BS)
        convs.append(toks)
        for _ in range(rng.randint(1, 3)):
            c.blocks_stored(rng.choice(list(c.workers)), keys[:rng.randint(8, 64)])
    place_s, choose_s = [], []
    for i in range(n_requests):
        base = rng.choice(convs)
        prompt = base[:rng.randint(16, 64) * BS] + [rng.randrange(32000) for _ in range(rng.randint(1, 2000))]
        t0 = time.perf_counter()
        keys = block_hashes(prompt, BS) if policy == "conductor" else ()
        t1 = time.perf_counter()
        d = c.place(PlacementRequest(f"r{i}", len(prompt), keys, 128))
        t2 = time.perf_counter()
        place_s.append(t2 - t1)
        choose_s.append(t2 - t0)
        # keep a realistic amount of work in flight: finish requests after a while
        c.prefill_done(d.request_id)
        if i >= 32:
            c.finished(f"r{i - 32}")
    return {"workers": n_workers, "policy": policy, "indexed_blocks": len(c.index), "requests": n_requests,
            "place_p50_us": round(pct(place_s, 50) * 1e6, 1), "place_p99_us": round(pct(place_s, 99) * 1e6, 1),
            "choose_p50_us": round(pct(choose_s, 50) * 1e6, 1), "choose_p99_us": round(pct(choose_s, 99) * 1e6, 1)}


def run_decision(args) -> dict:
    rows = [decision(n, args.blocks, pol, args.requests) for n in args.workers
            for pol in ("round_robin", "conductor")]
    print(f"{'workers':>7} {'policy':>12} {'blocks':>7} {'place p50':>10} {'place p99':>10} "
          f"{'hash+place p50':>15} {'hash+place p99':>15}   (microseconds)")
    for r in rows:
        print(f"{r['workers']:>7} {r['policy']:>12} {r['indexed_blocks']:>7} {r['place_p50_us']:>10} "
              f"{r['place_p99_us']:>10} {r['choose_p50_us']:>15} {r['choose_p99_us']:>15}")
    return {"bench": "conductor_decision", "rows": rows}


# ---------------------------------------------------------------- simulated workers
def run_sim(args) -> dict:
    from pdserve.plan.results import Targets
    from pdserve.plan.simulator import Cluster, SimSettings, Simulation
    from pdserve.plan.traffic import load_trace

    reqs = load_trace(TRACE, rate=args.rate, limit=args.requests)
    rows = []
    for pol in ("round_robin", "least_loaded", "conductor"):
        sim = Simulation(Cluster(prefill=args.workers // 2, decode=args.workers - args.workers // 2), gpu_like_cost(),
                         SimSettings(Targets(2.0, 0.1), policy=pol, kv_capacity_tokens=2_000_000))
        t0 = time.perf_counter()
        out = sim.run(reqs)
        hit = sum(max(0, j.cached) for j in sim.jobs) / sum(j.req.prompt_tokens for j in sim.jobs)
        rows.append({"policy": pol, "prefix_hit_rate": round(hit, 4),
                     "ttft_p50_s": round(out["ttft_s"]["p50"], 3), "ttft_p99_s": round(out["ttft_s"]["p99"], 3),
                     "ttft_mean_s": round(statistics.mean(j.first_token_s - j.req.arrival_s for j in sim.jobs
                                                          if j.first_token_s is not None), 3),
                     "decisions": out["decisions"], "sim_wall_s": round(time.perf_counter() - t0, 1)})
    seen: set[int] = set()
    ideal = tot = 0
    for r in reqs:
        i = 0
        while i < len(r.block_keys) and r.block_keys[i] in seen:
            i += 1
        ideal += i * BS
        tot += r.prompt_tokens
        seen.update(r.block_keys)
    print(f"{args.workers} simulated workers, {len(reqs)} trace requests at {args.rate} req/s; "
          f"hit rate of one shared infinite cache: {ideal / tot:.3f}")
    print(f"{'policy':>13} {'hit rate':>9} {'TTFT mean':>10} {'TTFT p50':>9} {'TTFT p99':>9}")
    for r in rows:
        print(f"{r['policy']:>13} {r['prefix_hit_rate']:>9} {r['ttft_mean_s']:>10} {r['ttft_p50_s']:>9} "
              f"{r['ttft_p99_s']:>9}")
    rr, co = rows[0], rows[-1]
    return {"bench": "conductor_sim", "workers": args.workers, "requests": len(reqs), "rate": args.rate,
            "ideal_hit_rate": round(ideal / tot, 4), "rows": rows,
            "hit_ratio_vs_rr": round(co["prefix_hit_rate"] / max(rr["prefix_hit_rate"], 1e-9), 2),
            "ttft_mean_ratio_vs_rr": round(co["ttft_mean_s"] / rr["ttft_mean_s"], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decision")
    d.add_argument("--blocks", type=int, default=100_000)
    d.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    d.add_argument("--requests", type=int, default=2000)
    s = sub.add_parser("sim")
    s.add_argument("--workers", type=int, default=64)
    s.add_argument("--requests", type=int, default=600)
    s.add_argument("--rate", type=float, default=30.0)
    args = ap.parse_args(argv)
    out = {"decision": run_decision, "sim": run_sim}[args.what](args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
