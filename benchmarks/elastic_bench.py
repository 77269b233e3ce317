"""Elastic roles against fixed ones on the same cores (issue 16): a mixed Poisson workload, one configuration
after another, each started through the launcher (``pdserve.bench.compare.launcher_config``: colocated1,
colocated2, 1p1d, 1p1d-conductor, elastic2 ...).

Workload: Poisson arrivals at ``--rate``; ``--long-frac`` of the prompts ``--long`` tokens (+-7%), the rest
``--short`` tokens (+-20%), ``--output`` output tokens each, greedy, ignore_eos; the same prompts for every
configuration. Model: a random Llama from ``pdserve.models.build_random_llama`` (``--layers``, ``--hidden``) in
fp32, so the run needs no download.

    PYTHONPATH=$PWD python benchmarks/elastic_bench.py --configs colocated1,colocated2,1p1d,elastic2 \\
        --requests 40 --rate 0.6

Prints a table (TTFT, TPOT p50/p99, goodput, req/s, the conductor's decisions), then one JSON line with every
figure and elastic's ratios to the best colocated configuration in the same run (TPOT p99, TTFT p50, goodput).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.compare import CompareSettings, launcher_config
from pdserve.bench.metrics import SLO, phase_summary, summarize
from pdserve.bench.prom import scrape
from pdserve.bench.runner import RunOptions, run
from pdserve.bench.workload import Session, Turn, Workload


def mixed_workload(requests: int, rate: float, long: int, short: int, long_frac: float, output: int,
                   vocab: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=requests)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    sessions = []
    for i in range(requests):
        is_long = rng.random() < long_frac
        n = int(long * rng.uniform(0.93, 1.07)) if is_long else int(short * rng.uniform(0.8, 1.2))
        ids = [int(t) for t in rng.integers(1000, vocab, size=n)]
        sessions.append(Session(i, float(arrivals[i]), [Turn(ids, output)]))
    return Workload("mixed", sessions, info={"long": long, "short": short, "long_frac": long_frac,
                                             "output": output, "rate": rate})


def _decisions(router_url: str) -> dict[str, float]:
    got = scrape(router_url, "pdserve_conductor_decisions_total", labels=True)
    return {kind: sum(v for k, v in got.items() if f'kind="{kind}"' in k)
            for kind in ("local", "disaggregated", "reject")}


def run_config(name: str, model: Path, wl: Workload, slo: SLO, max_model_len: int) -> dict[str, Any]:
    from pdserve.launcher import Cluster

    cfg = launcher_config(name, CompareSettings(model=str(model), dtype="float32", max_model_len=max_model_len))
    t0 = time.monotonic()
    with Cluster(cfg) as c:
        startup = time.monotonic() - t0
        print(f"[elastic_bench] {name}: up in {startup:.0f} s, running {len(wl.sessions)} requests", file=sys.stderr)
        before = _decisions(c.router_url)
        result = run(wl, RunOptions(url=c.router_url, model=c.model_name, progress=False))
        after = _decisions(c.router_url)
    out = summarize(result.records, result.wall_s, slo)
    out.update({k: v for k, v in phase_summary(result.records).items() if k.startswith("handoff")})
    out["decisions"] = {k: after[k] - before.get(k, 0.0) for k in after}
    out["startup_s"] = round(startup, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="colocated1,colocated2,1p1d,elastic2")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.6)
    p.add_argument("--long", type=int, default=1500)
    p.add_argument("--short", type=int, default=100)
    p.add_argument("--long-frac", type=float, default=0.25)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    a = p.parse_args(argv)
    from pdserve.models import build_random_llama

    model = build_random_llama(Path(tempfile.mkdtemp(prefix="elastic-bench-")) / "random-llama", layers=a.layers,
                               hidden=a.hidden, heads=a.hidden // 64, kv_heads=max(1, a.hidden // 128),
                               intermediate=3 * a.hidden)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    wl = mixed_workload(a.requests, a.rate, a.long, a.short, a.long_frac, a.output, vocab)
    slo = SLO(a.slo_ttft_ms, a.slo_tpot_ms)
    results = {name: run_config(name, model, wl, slo, max(4096, a.long * 2)) for name in a.configs.split(",")}
    cols = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput_req_per_s", "req_per_s",
            "handoff_p50_ms", "errors")
    print("| config | " + " | ".join(cols) + " | decisions (local/split/reject) |")
    print("|---" * (len(cols) + 2) + "|")
    for name, r in results.items():
        d = r["decisions"]
        print(f"| {name} | " + " | ".join(str(r.get(c, "-")) for c in cols)
              + f" | {d['local']:.0f}/{d['disaggregated']:.0f}/{d['reject']:.0f} |")
    ratios: dict[str, Any] = {}
    colocated = [n for n in results if n.startswith("colocated")]
    for e in (n for n in results if n.startswith("elastic")):
        if colocated:
            best = max(colocated, key=lambda n: (results[n].get("goodput_req_per_s") or 0.0))
            b, r = results[best], results[e]
            ratios[e] = {"baseline": best, **{k: round(r[k] / b[k], 3) if r.get(k) and b.get(k) else None
                                              for k in ("tpot_p99_ms", "ttft_p50_ms", "goodput_req_per_s")}}
    print(json.dumps({"bench": "elastic", "workload": wl.info, "requests": a.requests,
                      "model": {"layers": a.layers, "hidden": a.hidden}, "slo": [a.slo_ttft_ms, a.slo_tpot_ms],
                      "results": results, "ratios_vs_best_colocated": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
