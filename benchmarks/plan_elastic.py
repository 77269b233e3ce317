"""Elastic roles at GPU scale, on paper: elastic xN against the best fixed split (xPyD) and colocated xN for the same
device budget, simulated with the real conductor (policy ``conductor``) for issue 16's mixed workload and a
long-context one, at a few rates.

    .venv/bin/python benchmarks/plan_elastic.py            # ~3-6 min on 2 busy cores
    .venv/bin/python benchmarks/plan_elastic.py --quick    # one rate per workload
    .venv/bin/python benchmarks/plan_elastic.py --reject   # the conductor knows the targets (and may reject)

Default: Llama-3-70B on 16 H200 (8 workers of TP2) over EFA (p5en), the catalogue's 5 ms hand-off.
Workloads (Poisson, seed 0):
- mixed: 25% 1500-token and 75% 100-token prompts, 64 output tokens (issue 16); TTFT <= 1 s, TPOT <= 40 ms;
- long: 30% 12000-token and 70% 800-token prompts, 300 output tokens (docs/plan.md); TTFT <= 4 s (about 2x the
  unloaded 12K-token prefill, 2.1 s), TPOT <= 50 ms.
Prints one table row per (workload, rate, configuration), the elastic summary `pdserve plan` prints, then one JSON
line with the ratios elastic / best split and elastic / colocated (goodput, TPOT p99, TTFT p50, TTFT p99).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.plan.cost import HardwareCostModel, min_parallel  # noqa: E402
from pdserve.plan.hardware import accelerator, link, load_catalogue  # noqa: E402
from pdserve.plan.kvsize import load_model  # noqa: E402
from pdserve.plan.results import Targets  # noqa: E402
from pdserve.plan.search import candidates, elastic_summary, evaluate, rank  # noqa: E402
from pdserve.plan.simulator import SimSettings, config_kind  # noqa: E402
from pdserve.plan.traffic import LengthMix, poisson  # noqa: E402

WORKLOADS = {
    "mixed": ("0.25:1500:64,0.75:100:64", Targets(1.0, 0.04), 1000, [10.0, 20.0, 40.0]),
    "long": ("0.3:12000:300,0.7:800:300", Targets(4.0, 0.05), 600, [1.0, 2.0, 3.0]),
}


def _row(r: dict[str, Any]) -> dict[str, Any]:
    ms = lambda v: None if v is None else round(v * 1e3, 1)  # noqa: E731
    return {"config": r["config"], "goodput_rps": round(r["goodput_rps"], 3), "slo": round(r["slo_attainment"], 3),
            "ttft_p50_ms": ms(r["ttft_s"]["p50"]), "ttft_p99_ms": ms(r["ttft_s"]["p99"]),
            "tpot_p50_ms": ms(r["tpot_s"]["p50"]), "tpot_p99_ms": ms(r["tpot_s"]["p99"]),
            "decisions": r["decisions"], "split_prefills": r.get("split_prefills")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run(model: str, hardware: str, network: str, gpus: int, workloads: dict[str, Any], reject: bool = False
        ) -> list[dict[str, Any]]:
    spec, acc, net = load_model(model), accelerator(hardware), link(network)
    par = min_parallel(spec, acc, net)
    cost = HardwareCostModel(spec, acc, net, par, handoff_s=load_catalogue().handoff_s)
    clusters = candidates(gpus, par.devices, elastic=True)
    out = []
    for name, (lengths, targets, n, rates) in workloads.items():
        settings = SimSettings(targets, policy="conductor", kv_capacity_tokens=cost.kv_capacity_tokens(),
                               reject=reject)
        for rate in rates:
            reqs = poisson(rate, n, LengthMix.parse(lengths), seed=0)
            ranked = rank(evaluate(clusters, cost, settings, reqs))
            best = {k: _row(next(r for r in ranked if config_kind(r["config"]) == k))
                    for k in ("colocated", "pd", "elastic")}
            e, pd, co = best["elastic"], best["pd"], best["colocated"]
            res = {"workload": name, "lengths": lengths, "rate": rate, "ttft_target_s": targets.ttft_s,
                   "tpot_target_s": targets.tpot_s, "recommended": ranked[0]["config"], **best,
                   "summary": elastic_summary(ranked),
                   "goodput_by_config": {r["config"]: round(r["goodput_rps"], 3) for r in ranked}}
            for base, b in (("pd", pd), ("colocated", co)):
                res[f"elastic_vs_{base}"] = {k: _ratio(e[k], b[k]) for k in ("goodput_rps", "tpot_p99_ms",
                                                                           "ttft_p50_ms", "ttft_p99_ms")}
            out.append(res)
            for k in ("colocated", "pd", "elastic"):
                r = best[k]
                d = r["decisions"]
                print(f"{name:6s} {rate:5.1f}/s {r['config']:>13s}  goodput {r['goodput_rps']:6.2f}  "
                      f"TTFT p50/p99 {r['ttft_p50_ms']:7.0f}/{r['ttft_p99_ms']:7.0f} ms  "
                      f"TPOT p50/p99 {r['tpot_p50_ms']:5.1f}/{r['tpot_p99_ms']:6.1f} ms  "
                      f"local/PD/rej {d['local']}/{d['disaggregated']}/{d['reject']}", flush=True)
            print(f"  recommended {ranked[0]['config']}; split prefills per elastic worker: {e['split_prefills']}")
            print(f"  {res['summary']}", flush=True)
        _fixed_choice([r for r in out if r["workload"] == name])
    return out


def _fixed_choice(rows: list[dict[str, Any]]) -> None:
    """The split one would deploy (the best at the middle rate) held at every rate, against elastic: a fixed split
    is best only near the rate it was sized for, elastic needs no sizing."""
    mid = rows[len(rows) // 2]
    fixed = mid["pd"]["config"]
    for r in rows:
        g = r["goodput_by_config"]
        r["fixed_split"] = {"config": fixed, "goodput_rps": g[fixed],
                            "elastic_vs_fixed_goodput": _ratio(r["elastic"]["goodput_rps"], g[fixed])}
        print(f"{r['workload']:6s} {r['rate']:5.1f}/s  {fixed} (sized at {mid['rate']:g}/s) goodput {g[fixed]:.2f}, "
              f"elastic {r['elastic']['goodput_rps']:.2f} ({r['fixed_split']['elastic_vs_fixed_goodput']}x), "
              f"best split {r['pd']['config']} {r['pd']['goodput_rps']:.2f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one rate per workload")
    ap.add_argument("--model", default="llama-3-70b")
    ap.add_argument("--hardware", default="H200")
    ap.add_argument("--network", default="efa-p5en")
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--reject", action="store_true",
                    help="give the conductor the targets (as `pdserve plan --reject`): elastic drops the options "
                         "predicted to miss them, and requests with none left are rejected")
    args = ap.parse_args()
    loads = {k: (v[0], v[1], v[2], v[3][1:2] if args.quick else v[3]) for k, v in WORKLOADS.items()}
    rows = run(args.model, args.hardware, args.network, args.gpus, loads, args.reject)
    print(json.dumps({"model": args.model, "hardware": args.hardware, "network": args.network, "gpus": args.gpus,
                      "reject": args.reject, "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
