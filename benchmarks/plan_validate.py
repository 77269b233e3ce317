"""Simulated vs measured on this machine: does ``pdserve plan`` predict what a live pdserve stack does?

1. For each configuration, start it and calibrate on it: fit prefill and decode-step times from single
   requests and small batches (pdserve.plan.calibrate) and, for PD, the P -> D hand-off; the router, the
   vLLM API servers and the client share the two cores with the engines, so a calibration elsewhere misleads.
2. Then replay one Poisson workload on it (random token-id prompts, 25% long / 75% short, fixed output
   lengths) and simulate the same requests (same arrival times and lengths) with that calibration.
   Configurations: colocated x2, 1P1D round-robin, colocated x1 at half the rate, 1P1D with the conductor.
3. Table of TTFT p50 and TPOT p50/p99, measured vs simulated, with the error; then one JSON line.

    flock /tmp/pd/heavy.lock .venv/bin/python benchmarks/plan_validate.py            # ~12 min on 2 cores
    flock /tmp/pd/heavy.lock .venv/bin/python benchmarks/plan_validate.py --quick    # ~7 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from pdserve.bench.client import stream_completion  # noqa: E402
from pdserve.launch import Cluster  # noqa: E402
from pdserve.launch.config import LauncherConfig  # noqa: E402
from pdserve.plan.calibrate import Calibration, fit, measure  # noqa: E402
from pdserve.plan.kvsize import load_model  # noqa: E402
from pdserve.plan.measure import transfer_bytes_s  # noqa: E402
from pdserve.plan.results import Targets, percentiles  # noqa: E402
from pdserve.plan.simulator import Cluster as SimCluster  # noqa: E402
from pdserve.plan.simulator import SimSettings, simulate
from pdserve.plan.traffic import Request  # noqa: E402

KV_GIB = 1
CHUNK = 2048  # vLLM's CPU default max_num_batched_tokens


def log(msg: str) -> None:
    print(f"[plan_validate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def launch(**kw: Any) -> Cluster:
    cfg = LauncherConfig(port=0, kv_cache_gib=KV_GIB, max_model_len=2048, **kw)
    return Cluster(cfg, log=lambda s: log(s))


def workload(rate: float, n: int, seed: int, long_tokens: int, short_tokens: int, output: int) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = long_tokens if rng.random() < 0.25 else short_tokens
        out.append(Request(f"r{i}", t, prompt, output))
    return out


async def replay(url: str, reqs: list[Request], seed: int) -> list[dict[str, float]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 20000) for _ in range(r.prompt_tokens)] for r in reqs]
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()

        async def one(r: Request, ids: list[int]) -> dict[str, float]:
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
            rec = await stream_completion(session, url, {"prompt": ids, "max_tokens": r.output_tokens,
                                                         "ignore_eos": True})
            if not rec.ok or rec.end is None:
                return {"error": 1.0}
            n = max(rec.output_tokens, len(rec.chunk_times))
            return {"ttft": rec.ttft_s, "tpot": (rec.end - rec.first_token) / (n - 1) if n > 1 else None}

        return await asyncio.gather(*(one(r, p) for r, p in zip(reqs, prompts)))


def figures(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    t, p = percentiles(ttft), percentiles(tpot)
    return {"ttft_p50": t["p50"], "tpot_p50": p["p50"], "tpot_p99": p["p99"]}


async def first_gaps(url: str, count: int) -> list[float]:
    """Token 1 -> token 2 gap of single 1024-token requests (on PD: KV transfer + hand-off + one step)."""
    rng = random.Random(1)
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(count):
            rec = await stream_completion(s, url, {"prompt": [rng.randrange(1000, 20000) for _ in range(1024)],
                                                   "max_tokens": 8, "ignore_eos": True})
            if rec.ok and len(rec.chunk_times) > 2:
                out.append(rec.chunk_times[1] - rec.chunk_times[0])
    return out


def calibrate_on(url: str, decode_workers: int, model_kv: int, pd: bool, quick: bool) -> Calibration:
    """Fit the cost model on the running configuration itself (its processes share the same two cores).

    Decode batches go round-robin over ``decode_workers``: a batch of B at the router is B / n per worker.
    Prefill probes run with every engine busy: one per colocated worker at once, or beside two background
    decodes on PD."""
    n = decode_workers
    shapes = tuple((b * n, p) for b, p in ((1, 64), (2, 64), (4, 64), (1, 1024), (2, 1024)))
    pre, dec = asyncio.run(measure(url, decode_shapes=shapes, repeats=1 if quick else 2,
                                   prefill_parallel=1 if pd else n, background_streams=2 if pd else 0))
    dec = [(b // n, ctx // n, step) for b, ctx, step in dec]
    cal = fit(pre, dec, model_kv, transfer_bytes_s())
    if pd:
        cm = cal.cost_model()
        g = statistics.median(asyncio.run(first_gaps(url, 3 if quick else 5)))
        cal.handoff_s = max(0.0, g - cm.decode_step_s(1, 1024) - cm.transfer_s(1024 * model_kv))
    log(f"calibration: prefill {cal.prefill_coef}, decode {cal.decode_coef}, handoff {cal.handoff_s:.3f} s")
    return cal


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rate", type=float, default=0.7, help="req/s for the two-worker configurations")
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--only", help="comma-separated configuration names to run")
    ap.add_argument("--out", default="", help="also write the JSON result (with per-request records) here")
    args = ap.parse_args()
    n = args.requests or (30 if args.quick else 60)
    kv = int(load_model("smollm2-135m").kv_bytes_per_token())
    capacity = KV_GIB * (1 << 30) // kv
    configs = [("colocated x2", dict(colocated=2, cores=(0, 1)), SimCluster(colocated=2), "round_robin", 1.0),
               ("1P1D", dict(prefill=1, decode=1, cores=(0, 1)), SimCluster(prefill=1, decode=1), "round_robin", 1.0),
               ("colocated x1", dict(colocated=1, cores=(0,)), SimCluster(colocated=1), "round_robin", 0.5),
               ("1P1D conductor", dict(prefill=1, decode=1, cores=(0, 1), policy="conductor"),
                SimCluster(prefill=1, decode=1), "conductor", 1.0)]
    if args.only:
        keep = {x.strip() for x in args.only.split(",")}
        configs = [c for c in configs if c[0] in keep]
    rows = []
    pd_cal: Calibration | None = None
    for name, launch_kw, sim_cluster, policy, rate_factor in configs:
        reqs = workload(args.rate * rate_factor, n, 11, 1536, 128, 32)
        try:
            with launch(**launch_kw) as c:
                if policy == "conductor" and pd_cal is not None:
                    cal = pd_cal  # probes through the conductor land on P or D by its choice: reuse round-robin's
                else:
                    log(f"{name}: calibrating on {c.router_url}")
                    cal = calibrate_on(c.router_url, sim_cluster.colocated or sim_cluster.decode, kv,
                                       pd=not sim_cluster.colocated, quick=args.quick)
                    if not sim_cluster.colocated and policy == "round_robin":
                        pd_cal = cal
                log(f"{name}: replaying {n} requests at {args.rate * rate_factor}/s")
                got = asyncio.run(replay(c.router_url, reqs, 5))
        except Exception as exc:  # noqa: BLE001 - report the configuration that could not run, go on
            log(f"{name}: could not run: {exc}")
            rows.append({"config": name, "failed": str(exc).splitlines()[-1][:300]})
            continue
        ok = [g for g in got if "error" not in g]
        measured = figures([g["ttft"] for g in ok], [g["tpot"] for g in ok if g["tpot"] is not None])
        sim = simulate(sim_cluster, cal.cost_model(), SimSettings(Targets(1e9, 1e9), policy=policy,
                                                                  chunk_tokens=CHUNK, kv_capacity_tokens=capacity),
                       reqs)
        simulated = {"ttft_p50": sim["ttft_s"]["p50"], "tpot_p50": sim["tpot_s"]["p50"],
                     "tpot_p99": sim["tpot_s"]["p99"]}
        err = {k: (simulated[k] - measured[k]) / measured[k] for k in measured}
        rows.append({"config": name, "rate": args.rate * rate_factor, "errors": len(got) - len(ok),
                     "measured": measured, "simulated": simulated, "rel_error": err, "decisions": sim["decisions"],
                     "calibration": {"prefill_coef": cal.prefill_coef, "decode_coef": cal.decode_coef,
                                     "handoff_s": cal.handoff_s},
                     "records": [dict(g, prompt=r.prompt_tokens) for g, r in zip(got, reqs)]})
        log(f"{name}: measured {measured} simulated {simulated}")
    print(f"Poisson arrivals, {n} requests (25% 1536-token, 75% 128-token prompts, 32 output tokens), "
          "SmolLM2-135M bf16, one core per worker, cost model calibrated on each running configuration; "
          "times in ms, error = (simulated - measured) / measured")
    print(f"{'config':16s} {'':9s} {'TTFT p50':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s}")
    for r in rows:
        if "failed" in r:
            print(f"{r['config']:16s} could not run: {r['failed']}")
            continue
        for kind in ("measured", "simulated"):
            v = r[kind]
            print(f"{r['config']:16s} {kind:9s} {v['ttft_p50'] * 1e3:9.0f} {v['tpot_p50'] * 1e3:9.1f} "
                  f"{v['tpot_p99'] * 1e3:9.1f}")
        e = r["rel_error"]
        print(f"{r['config']:16s} {'error':9s} {e['ttft_p50']:+9.0%} {e['tpot_p50']:+9.0%} {e['tpot_p99']:+9.0%}")
    worst = max((abs(v) for r in rows if "rel_error" in r for v in r["rel_error"].values()), default=None)
    result = {"rows": rows, "worst_abs_rel_error": worst, "within_15pct": worst is not None and worst <= 0.15}
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    print(json.dumps({**result, "rows": [{k: v for k, v in r.items() if k != "records"} for r in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
