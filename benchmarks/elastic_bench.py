"""Elastic roles against fixed ones on the same cores (issue 16, "Measure"): the full matrix in one run.

Configurations (``pdserve.bench.compare.launcher_config`` names), one after another on the same cores, each
started ONCE through the launcher (``pdserve.launch.Cluster``) and then given, in order:

1. ``probe``: a closed-loop capacity probe (``--probe-concurrency`` clients, ``--probe-requests`` requests of
   the mixed prompt mix); its req/s is the configuration's capacity.
2. ``conv``: the packaged conversation trace scaled (``--conv-spec``: input x0.05, output x0.1, bursts
   spread), at ``--conv-rate`` (default: 70% of the first configuration's probed capacity, times the ratio of
   the mixed workload's mean prompt to the trace's, so both load the prefill side alike).
   Before each workload the script waits (bounded) for the shared machine's CPU to be quiet, and any workload
   cuts the requests arriving after ``--max-span-s``.
3. ``short``: ``--short-spec`` (docs/bench.md's short-prompt workload: Poisson 1 req/s, 64-token prompts, 32
   output tokens).
4. ``mixed``: Poisson arrivals, ``--long-frac`` of the prompts ``--long`` tokens (+-7%), the rest ``--short``
   tokens (+-20%), ``--output`` output tokens, at ``--mixed-frac`` (0.7) of the first configuration's probed
   capacity (so list colocated1 first), or at ``--mixed-rate``.

Every configuration gets the same prompts (fixed seeds); greedy, ignore_eos. Model: the default SmolLM2-135M-
Instruct folder (``--model`` overrides), dtype by the CPU rule (``--dtype`` overrides). Goodput targets: TTFT
<= 5 s and TPOT <= 100 ms (docs/bench.md). The 1-minute load average is sampled every 5 s all along (the
machine may be shared), summarized per workload and kept as a series in the JSON.

    PYTHONPATH=$PWD python benchmarks/elastic_bench.py --out bench-out/issue16

Prints a table per workload (TTFT and TPOT p50/p99, goodput, req/s, hand-off p50/p99 of the split requests,
conductor decisions, load), the goal ratios (elastic2 against the best colocated configuration on mixed; on
every workload against the better of colocated2 and 1p1d), then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.compare import CompareSettings, launcher_config
from pdserve.bench.matrix import LoadSampler, decode_spread, elastic_goals, handoff_stats, wait_for_quiet
from pdserve.bench.metrics import SLO, goodput, phase_summary, record_from_dict, summarize
from pdserve.bench.prom import delta, scrape
from pdserve.bench.runner import RunOptions, RunResult, run
from pdserve.bench.workload import Session, Turn, Workload, build_workload

DEFAULT_CONFIGS = "colocated1,colocated2,1p1d,1p1d-conductor,elastic2"


def mixed_workload(requests: int, rate: float, long: int, short: int, long_frac: float, output: int,
                   vocab: int, seed: int = 0, concurrency: int | None = None, name: str = "mixed") -> Workload:
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
    lens = [len(s.turns[0].prompt_ids) for s in sessions]
    return Workload(name, sessions, concurrency, info={"long": long, "short": short, "long_frac": long_frac,
                                                       "output": output, "rate": rate, "requests": requests,
                                                       "input_mean": float(np.mean(lens)),
                                                       "long_requests": sum(n > 2 * short for n in lens)})


def _decisions(router_url: str) -> dict[str, float]:
    """The conductor's decisions by kind, and the running decodes it moved (``moves``)."""
    try:
        got = scrape(router_url, "pdserve_conductor_decisions_total", labels=True)
        moves = scrape(router_url, "pdserve_router_moves_total")
    except OSError:
        return {}
    out = {kind: sum(v for k, v in got.items() if f'kind="{kind}"' in k)
           for kind in ("local", "disaggregated", "reject")}
    out["moves"] = sum(moves.values())
    return out


def _kv(urls: list[str]) -> dict[str, float]:
    tot: dict[str, float] = {}
    for u in urls:
        try:
            for k, v in scrape(u, "vllm:pdserve_kv_").items():
                tot[k] = tot.get(k, 0.0) + v
        except OSError:
            continue
    return tot


class Matrix:
    """Runs the workloads on one started cluster and keeps every summary and raw record."""

    def __init__(self, args: argparse.Namespace, slo: SLO, slo2: SLO, load: LoadSampler, out: Path | None) -> None:
        self.a, self.slo, self.slo2, self.load, self.out = args, slo, slo2, load, out
        self.results: dict[str, dict[str, Any]] = {}
        self.meta: dict[str, dict[str, Any]] = {}

    def timed_run(self, cluster: Any, wl: Workload, span_s: float,
                  quiet_wait_s: float = 0.0) -> tuple[RunResult, dict[str, Any]]:
        quiet = wait_for_quiet(self.a.quiet_busy, quiet_wait_s) if quiet_wait_s > 0 else {}
        dec0, kv0 = _decisions(cluster.router_url), _kv(cluster.worker_urls())
        t0 = time.monotonic()
        opts = RunOptions(url=cluster.router_url, model=cluster.model_name, progress=True,
                          duration_s=span_s + self.a.tail_s, drain_s=self.a.drain_s)
        res = run(wl, opts)
        t1 = time.monotonic()
        s = summarize(res.records, res.wall_s, self.slo)
        s["goodput2_req_per_s"] = goodput(res.records, res.wall_s, self.slo2)["goodput_req_per_s"]
        s.update(handoff_stats(res.records))
        s.update(decode_spread(res.records))
        s["modes"] = phase_summary(res.records).get("modes", {})
        dec = delta(dec0, _decisions(cluster.router_url))
        s["decisions"] = {k: int(v) for k, v in dec.items() if k != "moves"}
        s["moves"] = int(dec.get("moves", 0))
        kv = delta(kv0, _kv(cluster.worker_urls()))
        reads = kv.get("vllm:pdserve_kv_reads_total", 0.0)
        s["kv_reads"] = int(reads)
        if reads:
            s["kv_read_mean_ms"] = round(kv.get("vllm:pdserve_kv_read_seconds_sum", 0.0) * 1e3 / reads, 2)
        s.update(self.load.window(t0, t1))
        s.update(quiet)
        s["truncated"] = res.truncated
        errs = [r.error for r in res.records if not r.ok]
        if errs:
            s["first_error"] = errs[0]
        return res, s

    def save(self, config: str, res: RunResult) -> None:
        if self.out:
            raw = self.out / "raw"
            raw.mkdir(parents=True, exist_ok=True)
            slug = re.sub(r"[^A-Za-z0-9_.@-]+", "_", res.workload)
            (raw / f"{config}__{slug}.json").write_text(json.dumps(res.to_dict()))


def _span(wl: Workload) -> float:
    return max((s.arrival_s for s in wl.sessions), default=0.0)


def run_config(name: str, m: Matrix, rates: dict[str, Any]) -> None:
    from pdserve.launch import Cluster

    a = m.a
    settings = CompareSettings(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len)
    cfg = launcher_config(name, settings)
    log = lambda s: print(f"[elastic_bench] {name}: {s}", file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.monotonic()
    with Cluster(cfg, log=lambda s: None) as c:
        startup = time.monotonic() - t0
        vocab = json.loads((Path(c.model_dir) / "config.json").read_text())["vocab_size"]
        log(f"up in {startup:.0f} s")
        per: dict[str, Any] = {}
        probe = mixed_workload(a.probe_requests, 1.0, a.long, a.short, a.long_frac, a.output, vocab, seed=100,
                               concurrency=a.probe_concurrency, name="probe")
        res, s = m.timed_run(c, probe, a.probe_max_s, quiet_wait_s=a.quiet_wait_probe_s)
        m.save(name, res)
        per["probe"] = s
        log(f"probe: {s['req_per_s']} req/s closed loop ({a.probe_concurrency} clients)")
        mixed_mean = mixed_workload(200, 1.0, a.long, a.short, a.long_frac, a.output, vocab, seed=3).info["input_mean"]
        if "mixed" not in rates:  # the first configuration sets the rates for all
            rates["capacity_source"] = name
            rates["capacity"] = s["req_per_s"] or 0.1
            rates["mixed"] = a.mixed_rate or round(a.mixed_frac * rates["capacity"], 3)
        conv_base = build_workload(a.conv_spec, vocab_size=vocab, max_model_len=a.max_model_len,
                                   overrides={"seed": 1, "rate": 1.0})
        if "conv" not in rates:
            rates["conv"] = a.conv_rate or round(a.mixed_frac * rates["capacity"] * mixed_mean
                                                 / conv_base.info["input_mean"], 3)
        conv = build_workload(a.conv_spec, vocab_size=vocab, max_model_len=a.max_model_len,
                              overrides={"seed": 1, "rate": rates["conv"]})
        short = build_workload(a.short_spec, vocab_size=vocab, max_model_len=a.max_model_len,
                               overrides={"seed": 2})
        mixed = mixed_workload(a.mixed_requests, rates["mixed"], a.long, a.short, a.long_frac, a.output, vocab,
                               seed=0)
        for label, wl in (("conv", conv), ("short", short), ("mixed", mixed)):
            if label not in a.workloads.split(","):
                continue
            wl.name = label
            wl.sessions = [x for x in wl.sessions if x.arrival_s <= a.max_span_s]  # a slow probe's low rate
            log(f"{label}: {wl.num_requests} requests at {wl.offered_rate or 0:.3f} req/s")
            res, s = m.timed_run(c, wl, _span(wl), quiet_wait_s=a.quiet_wait_s)
            s["offered_rate"] = round(wl.offered_rate or 0.0, 4)
            s["input_mean"] = round(float(wl.info.get("input_mean") or 0.0), 1)
            m.save(name, res)
            per[label] = s
            log(f"{label}: goodput {s.get('goodput_req_per_s')} req/s, TTFT p50 {s.get('ttft_p50_ms')} ms, "
                f"TPOT p99 {s.get('tpot_p99_ms')} ms, errors {s['errors']}, load {s.get('load1_mean')}")
    m.results[name] = per
    m.meta[name] = {"startup_s": round(startup, 1), "mode": cfg.mode, "workers": cfg.num_workers}


COLS = (("TTFT p50/p99 (ms)", "ttft_p50_ms", "ttft_p99_ms"), ("TPOT p50/p99 (ms)", "tpot_p50_ms", "tpot_p99_ms"),
        ("goodput (req/s)", "goodput_req_per_s", None), ("goodput, relaxed", "goodput2_req_per_s", None),
        ("req/s", "req_per_s", None),
        ("hand-off p50/p99 (ms)", "handoff_p50_ms", "handoff_p99_ms"), ("split", "split_requests", None),
        ("short / long split", "short_split", "long_split"), ("decodes per worker", "decodes_per_worker", None),
        ("moves", "moves", None), ("errors", "errors", None), ("load1 mean", "load1_mean", None))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    if isinstance(v, list):
        return "/".join(str(x) for x in v) or "-"
    return str(v)


def print_tables(results: dict[str, dict[str, Any]], workloads: list[str]) -> None:
    for wl in workloads:
        print(f"\n**{wl}**\n")
        print("| config | " + " | ".join(c[0] for c in COLS) + " |")
        print("|---" * (len(COLS) + 1) + "|")
        for name, per in results.items():
            r = per.get(wl)
            if r is None:
                continue
            cells = [_fmt(r.get(k1)) + ("" if k2 is None else " / " + _fmt(r.get(k2))) for _, k1, k2 in COLS]
            print(f"| {name} | " + " | ".join(cells) + " |")


def print_goals(goals: dict[str, Any]) -> None:
    mg = goals["mixed_vs_best_colocated"]
    print(f"\n{goals['elastic']} on mixed against the best colocated ({mg['baseline']}):")
    for k in ("tpot_p99_ms", "ttft_p50_ms", "goodput_req_per_s"):
        g = mg[k]
        print(f"  {k}: {g['ratio']}x ({'<=' if g['sense'] == 'max' else '>='} {g['bound']}x) met={g['met']}")
    for wl, g in goals["goodput_vs_better_fixed"].items():
        print(f"  {wl}: goodput {g['goodput_ratio']}x the better fixed ({g['baseline']}) (>= {g['bound']}x) "
              f"met={g['met']}")


def goal_report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 16's goals for every elastic configuration, with goodput at the targets and at the relaxed pair."""
    goals: dict[str, Any] = {}
    for slo_name, key in (("targets", "goodput_req_per_s"), ("relaxed", "goodput2_req_per_s")):
        # the probe is a closed loop, not one of the goals' workloads
        res = {c: {w: {**r, "goodput_req_per_s": r.get(key)} for w, r in per.items() if w != "probe"}
               for c, per in results.items()}
        for e in (n for n in res if n.startswith("elastic")):
            g = elastic_goals(res, e, "mixed", [n for n in res if n.startswith("colocated")],
                              [n for n in ("colocated2", "1p1d") if n in res])
            goals.setdefault(e, {})[slo_name] = g
            print(f"\ngoodput at the {slo_name} ({key}):", end="")
            print_goals(g)
    return goals


def summarize_raw(dirs: list[Path], slo: SLO, slo2: SLO) -> dict[str, dict[str, Any]]:
    """Every configuration's summaries again from the raw records that runs with ``--out`` kept (``DIR/raw/
    CONFIG__WORKLOAD.json``); the figures a run scraped (conductor decisions, KV reads, load) come from
    ``DIR/results.json`` when that run finished, and are missing otherwise."""
    results: dict[str, dict[str, Any]] = {}
    for d in dirs:
        done = json.loads((d / "results.json").read_text())["results"] if (d / "results.json").is_file() else {}
        for f in sorted((d / "raw").glob("*__*.json")):
            config, label = f.stem.split("__", 1)
            raw = json.loads(f.read_text())
            recs = [record_from_dict(r) for r in raw["records"]]
            sm = {**done.get(config, {}).get(label, {}), **summarize(recs, raw["wall_s"], slo)}
            sm["goodput2_req_per_s"] = goodput(recs, raw["wall_s"], slo2)["goodput_req_per_s"]
            sm.update(handoff_stats(recs))
            sm.update(decode_spread(recs))
            sm["modes"] = phase_summary(recs).get("modes", {})
            sm["source"] = str(d)
            results.setdefault(config, {})[label] = sm
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="the first one's probe sets the rates")
    p.add_argument("--workloads", default="conv,short,mixed")
    p.add_argument("--model", default="", help="model folder (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--probe-requests", type=int, default=16)
    p.add_argument("--probe-concurrency", type=int, default=4)
    p.add_argument("--probe-max-s", type=float, default=90.0)
    p.add_argument("--mixed-requests", type=int, default=40)
    p.add_argument("--mixed-frac", type=float, default=0.7)
    p.add_argument("--mixed-rate", type=float, default=None)
    p.add_argument("--long", type=int, default=1500)
    p.add_argument("--short", type=int, default=100)
    p.add_argument("--long-frac", type=float, default=0.25)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--conv-spec", default="trace:input_scale=0.05,output_scale=0.1,requests=30,spread=1")
    p.add_argument("--conv-rate", type=float, default=None)
    p.add_argument("--short-spec", default="poisson:rate=1,input=64,output=32,requests=30")
    p.add_argument("--max-span-s", type=float, default=240.0,
                   help="requests arriving later than this are left out (bounds a run whose rate came out low)")
    p.add_argument("--quiet-busy", type=float, default=0.4,
                   help="before a workload, wait for the machine's CPU to be at most this busy (shared machine)")
    p.add_argument("--quiet-wait-probe-s", type=float, default=150.0, help="the longest wait before a probe")
    p.add_argument("--quiet-wait-s", type=float, default=45.0, help="the longest wait before other workloads")
    p.add_argument("--tail-s", type=float, default=30.0, help="sending stops this long after the last arrival")
    p.add_argument("--drain-s", type=float, default=60.0, help="then in-flight requests get this long")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--slo2-ttft-ms", type=float, default=10000.0, help="a relaxed second target pair")
    p.add_argument("--slo2-tpot-ms", type=float, default=200.0)
    p.add_argument("--from-raw", default="", help="DIR[,DIR...]: start nothing; the tables, goals and JSON line "
                   "again from the raw records of earlier runs' --out folders (a matrix run in parts)")
    p.add_argument("--out", default="", help="folder for results.json and every request's record")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.from_raw:
        dirs = [Path(d) for d in a.from_raw.split(",")]
        res = summarize_raw(dirs, SLO(a.slo_ttft_ms, a.slo_tpot_ms), SLO(a.slo2_ttft_ms, a.slo2_tpot_ms))
        order = [c for c in a.configs.split(",") if c in res] + [c for c in res if c not in a.configs.split(",")]
        res = {c: res[c] for c in order}
        print_tables(res, ["probe", *a.workloads.split(",")])
        meta = {str(d): json.loads((d / "results.json").read_text()).get("rates") for d in dirs
                if (d / "results.json").is_file()}
        print(json.dumps({"bench": "elastic_matrix", "merged_from": [str(d) for d in dirs], "rates": meta,
                          "slo": [a.slo_ttft_ms, a.slo_tpot_ms], "slo_relaxed": [a.slo2_ttft_ms, a.slo2_tpot_ms],
                          "results": res, "goals": goal_report(res)}))
        return 0
    configs = a.configs.split(",")
    for name in configs:  # every name valid before the first start-up
        launcher_config(name, CompareSettings(model=a.model))
    out = Path(a.out) if a.out else None
    slo = SLO(a.slo_ttft_ms, a.slo_tpot_ms)
    rates: dict[str, Any] = {}
    failed: dict[str, str] = {}
    t_start = time.monotonic()
    with LoadSampler(period_s=5.0) as load:
        m = Matrix(a, slo, SLO(a.slo2_ttft_ms, a.slo2_tpot_ms), load, out)
        for name in configs:
            try:
                run_config(name, m, rates)
            except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
                print(f"[elastic_bench] {name}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                failed[name] = f"{type(exc).__name__}: {exc}"
    workloads = ["probe", *a.workloads.split(",")]
    print_tables(m.results, workloads)
    goals = goal_report(m.results)
    from pdserve.launch.plan import worker_dtype

    doc = {"bench": "elastic_matrix", "configs": configs, "rates": rates, "slo": [a.slo_ttft_ms, a.slo_tpot_ms],
           "slo_relaxed": [a.slo2_ttft_ms, a.slo2_tpot_ms],
           "dtype": worker_dtype(a.dtype).dtype, "mixed": {"long": a.long, "short": a.short,
                                                           "long_frac": a.long_frac, "output": a.output},
           "conv_spec": a.conv_spec, "short_spec": a.short_spec, "results": m.results, "meta": m.meta,
           "failed": failed, "goals": goals, "wall_s": round(time.monotonic() - t_start, 1),
           "load1": {"mean": round(float(np.mean([v for _, v in load.samples])), 2) if load.samples else None,
                     "max": max((v for _, v in load.samples), default=None), "series_30s": load.series(30.0)}}
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
