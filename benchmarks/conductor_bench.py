"""Conductor benchmarks.

    python benchmarks/conductor_bench.py decision [--blocks 100000] [--workers 8 64] [--shortlist 32 0]
        Placement decision time (p50, p99) with N workers and 100k indexed blocks: the conductor alone, and the
        router's whole choice (block hashing of the prompt's token ids + placement). Baselines in the same run,
        on the same index and prompts: round-robin placement, and the conductor with every worker a candidate
        (shortlist 0, the full scan); each conductor row says how many of its decisions equal the full scan's.
    python benchmarks/conductor_bench.py sim [--workers 64] [--requests 600] [--rate 30]
        64 simulated workers (pdserve.plan's simulator, the conductor's own cost model) replaying a slice of the
        Mooncake conversation trace: prefix hit rate and TTFT, conductor vs round-robin vs least-loaded;
        ``--shortlist 4 8`` adds conductor rows (``conductor/4``) that weigh fewer workers than each role has.
    python benchmarks/conductor_bench.py live [--requests 60] ...
        A real 2P1D vLLM run (pdserve serve, SmolLM2) replaying a scaled slice of the trace, conductor vs
        round-robin in turn: prefix hit rate (vLLM's counters), TTFT mean/p99. ``--configs conductor,
        conductor/2routers`` compares one router with two replicas on one port (``--routers 2``: the kernel
        spreads the connections; the decisions shown are one replica's): prefix-hit tokens and TTFT p50, 2 routers
        over 1 (JSON ``replicas``), and what the lag in the load view cost (:func:`load_lag`: placements made
        behind the other replica's unreported prefills, and their TTFT against the rest).

Each prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.traces import default_trace, trace_lines  # noqa: E402
from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel, PlacementRequest  # noqa: E402
from pdserve.conductor.cost_model import Priors  # noqa: E402
from pdserve.conductor.index import PrefixIndex  # noqa: E402
from pdserve.conductor.shortlist import SHORTLIST  # noqa: E402
from pdserve.hashing import block_hashes  # noqa: E402

BS = 128


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def gpu_like_cost() -> OnlineCostModel:
    """An 8B-class model on one modern GPU: ~60 us/token prefill, 15 ms decode steps, 25 GB/s links."""
    return OnlineCostModel(131072, Priors(prefill=(0.02, 6e-5, 2e-10), decode=(0.015, 2e-4, 2e-8),
                                          bandwidth_bytes_s=25e9, transfer_overhead_s=0.001, handoff_s=0.005))


# ---------------------------------------------------------------- decision time
def fleet(n_workers: int, policy: str, shortlist: int, index: PrefixIndex | None = None,
          clock: Callable[[], float] = time.monotonic) -> Conductor:
    """n_workers // 2 prefill and the rest decode workers; ``shortlist`` 0: every worker is a candidate."""
    c = Conductor(ConductorConfig(policy=policy, block_size=BS), gpu_like_cost(), clock,
                  shortlist=shortlist or max(1, n_workers))
    n_p = n_workers // 2
    for i in range(n_p):
        c.add_worker(f"p{i}", "prefill", 1 << 20)
    for i in range(n_workers - n_p):
        c.add_worker(f"d{i}", "decode", 1 << 20)
    if index is not None:
        c.index = index
    return c


def indexed(n_workers: int, n_blocks: int, seed: int, tiers: bool = False) -> tuple[PrefixIndex, list[list[int]]]:
    """Conversations of 64-block (8K-token) prompts, each cached on 1-3 workers, until n_blocks keys are
    indexed. ``tiers``: each copy also in its worker's host offload (a longer prefix) one time in three, and a
    fifth of the conversations in the pool's memory and disk (issue 39's tier-aware placement)."""
    import numpy as np

    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    ids = list(fleet(n_workers, "round_robin", 1).workers)
    index = PrefixIndex()
    convs: list[list[int]] = []
    while len(index) < n_blocks:
        toks = nprng.integers(0, 32000, 64 * BS).tolist()
        keys = block_hashes(toks, BS)
        convs.append(toks)
        for _ in range(rng.randint(1, 3)):
            w, depth = rng.choice(ids), rng.randint(8, 64)
            index.stored(w, keys[:depth])
            if tiers and rng.random() < 1 / 3:
                index.stored(f"{w}#host", keys[:rng.randint(depth, 64)])
        if tiers and rng.random() < 0.2:
            index.stored("pool", keys[:rng.randint(8, 32)])
            index.stored("pool#pool_disk", keys[:rng.randint(16, 64)])
    return index, convs


def decision(n_workers: int, index: PrefixIndex, convs: list[list[int]], variants: list[tuple[str, int]],
             n_requests: int, seed: int = 0) -> list[dict]:
    """Place n_requests prompts (a conversation's prefix + up to 2000 new tokens) on one fleet per (policy,
    shortlist) variant, all sharing ``index``; 32 requests stay in flight. The variants take turns request by
    request (so the machine's noise hits them alike), and see the same prompts and the same simulated clock: each
    prefill takes 60 us per uncached token, so the cost model refits (inside some placements) on observations
    that depend only on the decisions."""
    rng = random.Random(seed + 1)
    runs = []
    for pol, k in variants:
        now = [0.0]
        runs.append((pol, k, fleet(n_workers, pol, k, index, lambda now=now: now[0]), now, [], [], [], {}))
    for i in range(n_requests):
        base = rng.choice(convs)
        prompt = base[:rng.randint(16, 64) * BS] + [rng.randrange(32000) for _ in range(rng.randint(1, 2000))]
        for pol, _, c, now, place_s, choose_s, picks, tiers in runs:
            now[0] = i * 0.1
            t0 = time.perf_counter()
            keys = block_hashes(prompt, BS) if pol == "conductor" else ()
            t1 = time.perf_counter()
            d = c.place(PlacementRequest(f"r{i}", len(prompt), keys, 128))
            t2 = time.perf_counter()
            place_s.append(t2 - t1)
            choose_s.append(t2 - t0)
            picks.append((d.kind, d.prefill, d.decode))
            tiers[d.fetch_tier or "none"] = tiers.get(d.fetch_tier or "none", 0) + 1
            # keep a realistic amount of work in flight: finish requests after a while
            now[0] += 6e-5 * (len(prompt) - d.cached_tokens)
            c.prefill_done(d.request_id)
            if i >= 32:
                c.finished(f"r{i - 32}")
    return [{"workers": n_workers, "policy": pol, "shortlist": k or "all", "indexed_blocks": len(index),
             "requests": n_requests,
             "place_p50_us": round(pct(place_s, 50) * 1e6, 1), "place_p99_us": round(pct(place_s, 99) * 1e6, 1),
             "choose_p50_us": round(pct(choose_s, 50) * 1e6, 1),
             "choose_p99_us": round(pct(choose_s, 99) * 1e6, 1), "fetch_tiers": tiers, "picks": picks}
            for pol, k, _, _, place_s, choose_s, picks, tiers in runs]


def run_decision(args) -> dict:
    rows = []
    for n in args.workers:
        index, convs = indexed(n, args.blocks, 0, args.tiers)
        variants = [("round_robin", 0)] + [("conductor", k) for k in args.shortlist]
        got = decision(n, index, convs, variants, args.requests)
        full = next((r["picks"] for r in got if r["shortlist"] == "all" and r["policy"] == "conductor"), None)
        for r in got:
            picks = r.pop("picks")
            if full is not None and r["policy"] == "conductor":
                r["same_decisions_as_all"] = round(sum(a == b for a, b in zip(picks, full)) / len(full), 4)
        rows += got
    print(f"{'workers':>7} {'policy':>12} {'shortlist':>9} {'blocks':>7} {'place p50':>10} {'place p99':>10} "
          f"{'hash+place p50':>15} {'hash+place p99':>15} {'same as all':>11}   (microseconds)")
    for r in rows:
        print(f"{r['workers']:>7} {r['policy']:>12} {r['shortlist']:>9} {r['indexed_blocks']:>7} "
              f"{r['place_p50_us']:>10} {r['place_p99_us']:>10} {r['choose_p50_us']:>15} {r['choose_p99_us']:>15} "
              f"{r.get('same_decisions_as_all', '-'):>11}")
    out: dict = {"bench": "conductor_decision", "tiers": args.tiers, "rows": rows}
    for n in args.workers:
        by = {r["shortlist"]: r for r in rows if r["workers"] == n and r["policy"] == "conductor"}
        if "all" in by and len(by) > 1:
            k = next(k for k in by if k != "all")
            out[f"p99_ratio_vs_all_{n}"] = round(by[k]["place_p99_us"] / by["all"]["place_p99_us"], 3)
    return out


# ---------------------------------------------------------------- simulated workers
def run_sim(args) -> dict:
    from pdserve.plan.results import Targets
    from pdserve.plan.simulator import Cluster, SimSettings, Simulation
    from pdserve.plan.traffic import load_trace

    reqs = load_trace(default_trace(), rate=args.rate, limit=args.requests)
    rows = []
    variants = [("round_robin", 0), ("least_loaded", 0), ("conductor", 0)] + [("conductor", k) for k in args.shortlist]
    for pol, k in variants:
        sim = Simulation(Cluster(prefill=args.workers // 2, decode=args.workers - args.workers // 2), gpu_like_cost(),
                         SimSettings(Targets(2.0, 0.1), policy=pol, kv_capacity_tokens=2_000_000))
        if k:
            sim.conductor.shortlist = k  # fewer candidates than workers per role: what the bound costs
        t0 = time.perf_counter()
        out = sim.run(reqs)
        hit = sum(max(0, j.cached) for j in sim.jobs) / sum(j.req.prompt_tokens for j in sim.jobs)
        rows.append({"policy": pol + (f"/{k}" if k else ""), "prefix_hit_rate": round(hit, 4),
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
    rr, co = rows[0], rows[2]
    return {"bench": "conductor_sim", "workers": args.workers, "requests": len(reqs), "rate": args.rate,
            "ideal_hit_rate": round(ideal / tot, 4), "rows": rows,
            "hit_ratio_vs_rr": round(co["prefix_hit_rate"] / max(rr["prefix_hit_rate"], 1e-9), 2),
            "ttft_mean_ratio_vs_rr": round(co["ttft_mean_s"] / rr["ttft_mean_s"], 3)}


# ---------------------------------------------------------------- live 2P1D
def sample_conversations(n_requests: int, seed: int) -> list[dict]:
    """Whole conversations (rows sharing their first two hash ids) drawn at random until ``n_requests`` rows,
    in time order: a small slice that keeps the trace's multi-turn prefix reuse (consecutive rows share
    little: conversations' turns are minutes apart)."""
    rows = [json.loads(line) for _, line in trace_lines(default_trace())]
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r["hash_ids"][:2]), []).append(i)
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    pick: list[int] = []
    for k in keys:
        if len(pick) >= n_requests:
            break
        pick += groups[k]
    return [rows[i] for i in sorted(pick)]


def trace_reuse(rows: list[dict]) -> float:
    seen: set[int] = set()
    hit = tot = 0
    for r in rows:
        i = 0
        while i < len(r["hash_ids"]) and r["hash_ids"][i] in seen:
            i += 1
        hit += min(i * 512, r["input_length"])
        tot += r["input_length"]
        seen.update(r["hash_ids"])
    return hit / tot


def scaled_requests(rows: list[dict], input_scale: float, duration_s: float, max_input: int, output: int,
                    vocab: int) -> list[tuple[float, list[int], int]]:
    """(send time s, token ids, max_tokens): equal hash ids give equal token blocks of 512 * input_scale."""
    import numpy as np

    per = max(1, round(512 * input_scale))
    t0, t1 = rows[0]["timestamp"], rows[-1]["timestamp"]
    out = []
    for r in rows:
        n = min(max_input, max(1, round(r["input_length"] * input_scale)))
        toks: list[int] = []
        for h in r["hash_ids"]:
            if len(toks) >= n:
                break
            toks += np.random.default_rng([7, h]).integers(100, vocab, per).tolist()
        toks = toks[:n]
        at = (r["timestamp"] - t0) / max(1, t1 - t0) * duration_s
        out.append((at, toks, output))
    return out


async def _send_all(url: str, model: str, reqs: list[tuple[float, list[int], int]]) -> list[dict]:
    """Send each request at its time; per request: TTFT and e2e as the client saw them, the replica that answered
    (``X-Pdserve-Replica``) and the router's own timings of it (``X-Pdserve-Timings``: its prefill worker, when it
    was placed, how long P took)."""
    import asyncio

    import aiohttp

    async def one(session: aiohttp.ClientSession, at: float, toks: list[int], mx: int, start: float) -> dict:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        t0 = time.perf_counter()
        first = None
        failed = False
        timings: dict = {}
        body = {"model": model, "prompt": toks, "max_tokens": mx, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with session.post(url + "/v1/completions", json=body, headers={"X-Pdserve-Timings": "1"}) as resp:
            replica = resp.headers.get("X-Pdserve-Replica", "")
            if resp.status != 200:
                return {"ok": False, "status": resp.status}
            async for line in resp.content:
                if line.startswith(b"data: ") and b'"text"' in line and first is None:
                    first = time.perf_counter()
                if b"pdserve_timings" in line:
                    timings = json.loads(line[6:])["pdserve_timings"]
                if line.startswith(b'data: {"error"'):
                    failed = True
        return {"ok": first is not None, "failed_mid_stream": failed, "ttft": (first or t0) - t0,
                "e2e": time.perf_counter() - t0,
                "prompt": len(toks), "sent": t0 - start, "replica": replica,
                "prefill_worker": timings.get("prefill_worker"), "queue_ms": timings.get("queue_ms"),
                "prefill_ms": timings.get("prefill_ms")}

    start = time.perf_counter() + 0.5
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        return await asyncio.gather(*(one(session, at, t, mx, start) for at, t, mx in reqs))


def load_lag(records: list[dict], lag_s: float) -> dict:
    """What the lag in the load view cost, from the requests' own records (client send time + the router's
    queue_ms = when it was placed; + prefill_ms = when P answered; its prefill worker; the replica that placed it).

    A placement is *behind* when, at that moment, its prefill worker had more prefills in flight (any replica's)
    than another prefill worker had; some of that is deliberate (the conductor follows the prefix), so the
    one-router run gives the base rate. It is *stale* when it is behind only because of prefills another replica
    had placed there less than ``lag_s`` before (not yet in any /metrics report this replica could have read):
    without those, its worker would not have been the busier one. Reports how many placements were each and the
    TTFT p50 of the stale ones against the others'."""
    placed = []
    for r in records:
        if r.get("ok") and r.get("prefill_worker") and r.get("queue_ms") is not None \
                and r.get("prefill_ms") is not None:
            at = r["sent"] + r["queue_ms"] / 1000.0
            placed.append((at, at + r["prefill_ms"] / 1000.0, r))
    workers = sorted({r["prefill_worker"] for _, _, r in placed})
    behind = stale = 0
    stale_ttft: list[float] = []
    other_ttft: list[float] = []
    for at, _, r in placed:
        running = {w: [x for a, e, x in placed if x is not r and x["prefill_worker"] == w and a < at < e]
                   for w in workers}
        mine = running[r["prefill_worker"]]
        least_other = min((len(v) for w, v in running.items() if w != r["prefill_worker"]), default=len(mine))
        unseen = [x for x in mine if x.get("replica") != r.get("replica")
                  and at - (x["sent"] + x["queue_ms"] / 1000.0) < lag_s]
        is_behind = len(mine) > least_other
        is_stale = is_behind and len(mine) - len(unseen) <= least_other
        behind += is_behind
        stale += is_stale
        (stale_ttft if is_stale else other_ttft).append(r["ttft"])
    n = max(1, len(placed))
    return {"placements": len(placed), "lag_s": lag_s, "behind": behind, "behind_pct": round(100 * behind / n, 1),
            "stale": stale, "stale_pct": round(100 * stale / n, 1),
            "stale_ttft_p50_s": round(pct(stale_ttft, 50), 3) if stale_ttft else None,
            "other_ttft_p50_s": round(pct(other_ttft, 50), 3) if other_ttft else None,
            "by_replica": {k: sum(1 for _, _, r in placed if r.get("replica") == k)
                           for k in sorted({r.get("replica") or "" for _, _, r in placed})}}


def _worker_counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hits, queries) summed over ``urls``' vLLM counters."""
    from pdserve.bench.prom import scrape

    got = [scrape(u, "vllm:prefix_cache_", timeout_s=30) for u in urls]
    return (sum(g.get("vllm:prefix_cache_hits_total", 0.0) for g in got),
            sum(g.get("vllm:prefix_cache_queries_total", 0.0) for g in got))


def run_live(args) -> dict:
    import asyncio

    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig

    rows = sample_conversations(args.requests, args.seed)
    reuse = trace_reuse(rows)
    results = []
    for name, policy, extra, routers in (("round_robin", "round_robin", (), 1),
                                         ("conductor", "conductor", ("--local-prefill-tokens", "0"), 1),
                                         ("conductor+local", "conductor", (), 1),
                                         ("conductor/2routers", "conductor", ("--local-prefill-tokens", "0"), 2)):
        if name not in args.configs.split(","):
            continue
        cfg = LauncherConfig(model=args.model, prefill=2, decode=1, port=0, max_model_len=args.max_model_len,
                             policy=policy, router_args=extra, run_dir=str(Path(args.run_dir) / name),
                             routers=routers)
        with Cluster(cfg) as c:
            vocab = json.loads((c.model_dir / "config.json").read_text()).get("vocab_size", 32000)
            reqs = scaled_requests(rows, args.input_scale, args.duration, args.max_model_len - args.output - 1,
                                   args.output, vocab)
            if policy == "conductor":
                time.sleep(args.settle)  # let the start-up calibration finish before the run
            h0, q0 = _worker_counters(c.worker_urls("prefill"))
            t0 = time.perf_counter()
            out = asyncio.run(_send_all(c.router_url, c.model_name, reqs))
            wall = time.perf_counter() - t0
            h1, q1 = _worker_counters(c.worker_urls("prefill"))
            import urllib.request

            listing = json.loads(urllib.request.urlopen(c.router_url + "/v1/pdserve/workers", timeout=30).read())
        ok = [o for o in out if o["ok"]]
        ttft = [o["ttft"] for o in ok]
        results.append({"config": name, "routers": routers, "ok": len(ok), "requests": len(out),
                        "failed_mid_stream": sum(1 for o in out if o.get("failed_mid_stream")),
                        "wall_s": round(wall, 1), "prefill_hit_rate": round((h1 - h0) / max(1.0, q1 - q0), 4),
                        "prefix_hit_tokens": int(h1 - h0), "prefill_tokens_computed": int((q1 - q0) - (h1 - h0)),
                        "ttft_mean_s": round(statistics.mean(ttft), 3), "ttft_p50_s": round(pct(ttft, 50), 3),
                        "ttft_p99_s": round(pct(ttft, 99), 3), "decisions": listing.get("decisions"),
                        "load_lag": load_lag(out, args.lag)})
    print(f"2P1D, {len(rows)} requests from whole conversations of the trace (within-slice prefix reuse "
          f"{reuse:.2f}), lengths x{args.input_scale}, over {args.duration:.0f} s")
    print(f"{'config':>18} {'ok':>4} {'P hit rate':>10} {'P hit tokens':>12} {'P tokens computed':>18} "
          f"{'TTFT mean':>10} {'p50':>7} {'p99':>7} {'behind':>7} {'stale':>6} {'stale p50':>9} {'rest p50':>8}")
    for r in results:
        lag = r["load_lag"]
        print(f"{r['config']:>18} {r['ok']:>4} {r['prefill_hit_rate']:>10} {r['prefix_hit_tokens']:>12} "
              f"{r['prefill_tokens_computed']:>18} {r['ttft_mean_s']:>10} {r['ttft_p50_s']:>7} {r['ttft_p99_s']:>7} "
              f"{lag['behind']:>7} {lag['stale']:>6} {str(lag['stale_ttft_p50_s']):>9} "
              f"{str(lag['other_ttft_p50_s']):>8}")
    print(f"behind: placed where more prefills ran (any replica's) than on another P; stale: behind only because "
          f"of the other replica's prefills placed there < {args.lag:g} s before (not yet in a /metrics report)")
    out = {"bench": "conductor_live", "trace_reuse": round(reuse, 4), "rows": results}
    by = {r["config"]: r for r in results}
    if "conductor" in by and "conductor/2routers" in by:  # placement quality with replicas: 2 against 1
        one, two = by["conductor"], by["conductor/2routers"]
        out["replicas"] = {
            "prefix_hit_tokens_ratio": round(two["prefix_hit_tokens"] / max(1, one["prefix_hit_tokens"]), 3),
            "ttft_p50_ratio": round(two["ttft_p50_s"] / one["ttft_p50_s"], 3),
            "ttft_mean_ratio": round(two["ttft_mean_s"] / one["ttft_mean_s"], 3),
            "stale_placements": two["load_lag"]["stale"], "placements": two["load_lag"]["placements"],
            "ratio_of": "conductor/2routers / conductor"}
    if len(results) >= 2:
        rr, co = results[0], results[1]
        out["ttft_mean_ratio"] = round(co["ttft_mean_s"] / rr["ttft_mean_s"], 3)
        out["ttft_p99_ratio"] = round(co["ttft_p99_s"] / rr["ttft_p99_s"], 3)
        out["ttft_p50_ratio"] = round(co["ttft_p50_s"] / rr["ttft_p50_s"], 3)
        out["prefill_tokens_computed_ratio"] = round(co["prefill_tokens_computed"]
                                                     / max(1, rr["prefill_tokens_computed"]), 3)
        out["ratio_of"] = f"{co['config']} / {rr['config']}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decision")
    d.add_argument("--blocks", type=int, default=100_000)
    d.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    d.add_argument("--requests", type=int, default=2000)
    d.add_argument("--tiers", action="store_true", help="index host-offload and pool memory/disk tiers too")
    d.add_argument("--shortlist", type=int, nargs="+", default=[SHORTLIST, 0],
                   help="least-loaded candidates per role; 0: every worker (the full scan, the baseline)")
    s = sub.add_parser("sim")
    s.add_argument("--workers", type=int, default=64)
    s.add_argument("--requests", type=int, default=600)
    s.add_argument("--rate", type=float, default=30.0)
    s.add_argument("--shortlist", type=int, nargs="*", default=[],
                   help="extra conductor rows weighing only the prefix holders + this many least-loaded per role")
    lv = sub.add_parser("live")
    lv.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct)")
    lv.add_argument("--requests", type=int, default=60)
    lv.add_argument("--seed", type=int, default=1)
    lv.add_argument("--input-scale", type=float, default=0.125)
    lv.add_argument("--output", type=int, default=16)
    lv.add_argument("--duration", type=float, default=120.0, help="seconds the slice is compressed into")
    lv.add_argument("--max-model-len", type=int, default=4096)
    lv.add_argument("--settle", type=float, default=20.0, help="seconds for the conductor's calibration")
    lv.add_argument("--configs", default="round_robin,conductor,conductor+local",
                    help="comma-separated: round_robin, conductor, conductor+local, conductor/2routers")
    lv.add_argument("--run-dir", default=".pdserve/conductor-bench")
    lv.add_argument("--lag", type=float, default=1.0,
                    help="seconds another replica's placement takes to show in a worker report this one reads "
                         "(the router's load_interval_s)")
    args = ap.parse_args(argv)
    out = {"decision": run_decision, "sim": run_sim, "live": run_live}[args.what](args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
