"""Turn comparison results into ``results.json``, ``report.md`` and PNG plots.

The verdict per workload: the configuration with the highest goodput wins (ties: lower TPOT p99); "by how much"
is its goodput, TPOT p99 and TTFT p50 as ratios to the runner-up. Over a rate sweep of one workload the report
also gives the crossover: the offered rate where a configuration's goodput ratio to the baseline (the first
configuration) crosses 1, interpolated linearly between measured rates.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

TABLE_COLS = (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("tpot_p50_ms", "TPOT p50"),
              ("handoff_gap_p50_ms", "gap p50"), ("handoff_gap_p99_ms", "gap p99"), ("tpot_p99_ms", "TPOT p99"),
              ("itl_p99_ms", "ITL p99"), ("e2e_p50_ms", "E2E p50"),
              ("req_per_s", "req/s"), ("output_tok_per_s", "out tok/s"), ("goodput_req_per_s", "goodput"),
              ("slo_attainment", "SLO met"), ("errors", "errors"))
PHASE_COLS = (("queue_p50_ms", "queue"), ("prefill_p50_ms", "prefill"), ("handoff_p50_ms", "hand-off"),
              ("kv_read_mean_ms", "KV read (mean)"), ("kv_read_mean_bytes", "KV bytes (mean)"),
              ("kv_read_share_of_ttft_p50", "KV read / TTFT p50"),
              ("kv_read_share_of_handoff_p50", "KV read / hand-off p50"), ("decode_p50_ms", "decode"),
              ("router_overhead_p50_ms", "router overhead"))
KV_COLS = (("handoff_p50_ms", "hand-off p50"), ("handoff_p99_ms", "hand-off p99"),
           ("kv_bytes_per_request", "KV bytes/req"), ("prefill_tokens_computed", "prefill tokens computed"),
           ("prefix_cache_tokens", "prefix-cache tokens"), ("pool_hit_tokens", "pool hit tokens"),
           ("prefill_external_tokens", "P external tokens"),
           ("pool_get_gbps", "pool get GB/s"), ("pool_put_gbps", "pool put GB/s"))


def slug(s: str) -> str:
    """``s`` as a file-name part: runs of anything but letters, digits and ``_.@-`` become one ``_``."""
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", s)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def _rank_key(row: dict[str, Any]) -> tuple[float, float]:
    g = row.get("goodput_req_per_s")
    t = row.get("tpot_p99_ms")
    return (-(g if g is not None else -1.0), t if t is not None else math.inf)


def verdict(results: dict[str, Any], label: str) -> dict[str, Any]:
    """Winner of one workload and how it compares with the runner-up and with the baseline."""
    order = results["order"]
    rows = {c: results["configs"][c]["workloads"][label] for c in order if label in results["configs"][c]["workloads"]}
    ranked = sorted(rows, key=lambda c: _rank_key(rows[c]))
    win = ranked[0]
    out: dict[str, Any] = {"workload": label, "winner": win, "ranking": ranked}
    if len(ranked) > 1:
        second = ranked[1]
        w, s = rows[win], rows[second]
        out.update(runner_up=second,
                   goodput_ratio=ratio(w.get("goodput_req_per_s"), s.get("goodput_req_per_s")),
                   tpot_p99_ratio=ratio(w.get("tpot_p99_ms"), s.get("tpot_p99_ms")),
                   ttft_p50_ratio=ratio(w.get("ttft_p50_ms"), s.get("ttft_p50_ms")))
    b = rows[order[0]]
    out["vs_baseline"] = {c: {"goodput_ratio": ratio(rows[c].get("goodput_req_per_s"), b.get("goodput_req_per_s")),
                              "tpot_p99_ratio": ratio(rows[c].get("tpot_p99_ms"), b.get("tpot_p99_ms")),
                              "ttft_p50_ratio": ratio(rows[c].get("ttft_p50_ms"), b.get("ttft_p50_ms"))}
                          for c in order[1:] if c in rows}
    return out


def crossover(xs: list[float], ys: list[float | None], level: float = 1.0) -> float | None:
    """First x where y crosses ``level`` (from either side), linearly interpolated; None if it never does."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if (y0 - level) == 0:
            return x0
        if (y0 - level) * (y1 - level) < 0:
            return round(x0 + (level - y0) * (x1 - x0) / (y1 - y0), 4)
    return None


def rate_sweeps(results: dict[str, Any]) -> dict[str, list[tuple[float, str]]]:
    """Workload labels grouped by base name (``name@rate``) -> [(offered rate, label)], sorted by rate."""
    groups: dict[str, list[tuple[float, str]]] = {}
    for label in results["workloads"]:
        base, at, rate = label.rpartition("@")
        if at:
            try:
                groups.setdefault(base, []).append((float(rate), label))
            except ValueError:
                continue
    return {k: sorted(v) for k, v in groups.items() if len(v) >= 2}


def sweep_crossovers(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    base = results["order"][0]
    for name, pts in rate_sweeps(results).items():
        xs = [r for r, _ in pts]
        for c in results["order"][1:]:
            rows = [(results["configs"][c]["workloads"].get(lbl), results["configs"][base]["workloads"].get(lbl))
                    for _, lbl in pts]
            g = [ratio(a and a.get("goodput_req_per_s"), b and b.get("goodput_req_per_s")) for a, b in rows]
            t = [ratio(a and a.get("tpot_p99_ms"), b and b.get("tpot_p99_ms")) for a, b in rows]
            out.append({"workload": name, "config": c, "baseline": base, "rates": xs, "goodput_ratio": g,
                        "tpot_p99_ratio": t, "goodput_crossover_rate": crossover(xs, g),
                        "tpot_p99_crossover_rate": crossover(xs, t)})
    return out


def _table(results: dict[str, Any], label: str, cols: tuple[tuple[str, str], ...]) -> list[str]:
    lines = ["| config | " + " | ".join(h for _, h in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for c in results["order"]:
        row = results["configs"][c]["workloads"].get(label)
        if row is None:
            continue
        lines.append(f"| {c} | " + " | ".join(_fmt(row.get(k)) for k, _ in cols) + " |")
    return lines


def markdown(results: dict[str, Any], verdicts: list[dict[str, Any]], crossovers: list[dict[str, Any]],
             plots: dict[str, list[str]], command: str | None = None) -> str:
    slo = results.get("slo", {})
    lines = ["# pdserve bench compare", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [f"Configurations (in run order, same cores {results.get('cores')}): {', '.join(results['order'])}. "
              f"Baseline: {results['order'][0]}. Goodput targets: TTFT <= {slo.get('ttft_ms')} ms, "
              f"TPOT <= {slo.get('tpot_ms')} ms. Times in ms from the client's clock; phases from the router.", ""]
    if results.get("dtype"):
        lines += [f"Workers' dtype: {results['dtype']['dtype']} ({results['dtype']['reason']}).", ""]
    for c, why in (results.get("failed") or {}).items():
        lines += [f"**{c} failed** and is left out: {why}", ""]
    lines += ["## Verdict", ""]
    for v in verdicts:
        s = f"- **{v['workload']}**: **{v['winner']}** wins"
        if v.get("runner_up"):
            s += (f" over {v['runner_up']}: goodput {_fmt(v.get('goodput_ratio'))}x, TPOT p99 "
                  f"{_fmt(v.get('tpot_p99_ratio'))}x, TTFT p50 {_fmt(v.get('ttft_p50_ratio'))}x")
        lines.append(s + ".")
    for x in crossovers:
        g = x["goodput_crossover_rate"]
        t = x["tpot_p99_crossover_rate"]
        lines.append(f"- **{x['workload']}** sweep, {x['config']} / {x['baseline']}: goodput ratio "
                     f"{', '.join(_fmt(r) for r in x['goodput_ratio'])} at {', '.join(_fmt(r) for r in x['rates'])} "
                     f"req/s (crosses 1 at {_fmt(g) if g is not None else 'no rate measured'}); TPOT p99 ratio "
                     f"{', '.join(_fmt(r) for r in x['tpot_p99_ratio'])} (crosses 1 at "
                     f"{_fmt(t) if t is not None else 'no rate measured'}).")
    lines.append("")
    for label in results["workloads"]:
        infos = (results["configs"][c]["workloads"][label].get("workload_info") for c in results["order"]
                 if label in results["configs"][c]["workloads"])
        info: dict[str, Any] = next(infos, {}) or {}
        desc = ", ".join(f"{k}={_fmt(info[k])}" for k in ("requests", "input_mean", "output_mean", "rate", "span_s")
                         if k in info and not isinstance(info[k], dict))
        lines += [f"## {label}", "", f"Workload: `{info.get('spec', label)}` ({desc}).", ""]
        lines += _table(results, label, TABLE_COLS) + [""]
        lines += ["Server-side phases (p50 unless noted, ms):", ""] + _table(results, label, PHASE_COLS) + [""]
        lines += ["KV moved and computed (workers' counters; pdserve/bench/kv_counters.py):", ""]
        lines += _table(results, label, KV_COLS) + [""]
        for p in plots.get(label, []):
            lines.append(f"![{p}]({p})")
        lines.append("")
    for p in plots.get("_sweep", []):
        lines += [f"![{p}]({p})", ""]
    lines += ["## Start-up", ""] + [f"- {c}: {results['configs'][c]['startup_s']} s to healthy "
                                     f"({results['configs'][c]['workers']} workers)" for c in results["order"]]
    return "\n".join(lines) + "\n"


def _load_raw(out_dir: Path, config: str, label: str) -> list[dict[str, Any]]:
    p = out_dir / "raw" / f"{config}__{slug(label)}.json"
    if not p.is_file():
        return []
    return json.loads(p.read_text())["records"]


def plot(results: dict[str, Any], out_dir: Path) -> dict[str, list[str]]:
    """Latency CDFs and TPOT over time per workload, goodput and TPOT p99 vs rate per sweep. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    made: dict[str, list[str]] = {}
    for label in results["workloads"]:
        recs = {c: [r for r in _load_raw(out_dir, c, label) if r["ok"]] for c in results["order"]}
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, key, title in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT", "TPOT", "end-to-end latency")):
            for c, rs in recs.items():
                vals = np.sort([r[key] * 1e3 for r in rs if r.get(key) is not None])
                if len(vals):
                    ax.plot(vals, np.arange(1, len(vals) + 1) / len(vals), label=c)
            ax.set_xlabel(f"{title} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{title} CDF")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(label)
        fig.tight_layout()
        cdf = f"cdf_{slug(label)}.png"
        fig.savefig(out_dir / cdf, dpi=90)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(10, 4))
        for c, rs in recs.items():
            pts = sorted((r["start_s"], r["tpot_s"] * 1e3) for r in rs if r.get("tpot_s") is not None)
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, alpha=0.5, label=c)
        ax.set_xlabel("request sent at (s from start)")
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"TPOT over time: {label}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tt = f"tpot_time_{slug(label)}.png"
        fig.savefig(out_dir / tt, dpi=90)
        plt.close(fig)
        made[label] = [cdf, tt]
    sweeps = rate_sweeps(results)
    if sweeps:
        fig, axes = plt.subplots(len(sweeps), 3, figsize=(15, 4 * len(sweeps)), squeeze=False)
        for row, (name, pts) in zip(axes, sweeps.items()):
            for ax, key, title in zip(row, ("goodput_req_per_s", "tpot_p99_ms", "ttft_p50_ms"),
                                      ("goodput (req/s)", "TPOT p99 (ms)", "TTFT p50 (ms)")):
                for c in results["order"]:
                    xs, ys = [], []
                    for rate, lbl in pts:
                        v = results["configs"][c]["workloads"].get(lbl, {}).get(key)
                        if v is not None:
                            xs.append(rate)
                            ys.append(v)
                    ax.plot(xs, ys, marker="o", label=c)
                ax.set_xlabel("offered rate (req/s)")
                ax.set_ylabel(title)
                ax.set_title(f"{title} vs rate")
                ax.grid(alpha=0.3)
                ax.legend()
            row[0].annotate(name, (0, 1.12), xycoords="axes fraction", fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / "goodput_vs_rate.png", dpi=90)
        plt.close(fig)
        made["_sweep"] = ["goodput_vs_rate.png"]
    return made


def write_report(results: dict[str, Any], out_dir: Path, command: str | None = None,
                 plots: bool = True) -> dict[str, Any]:
    """Write results.json and report.md (and PNGs when ``plots`` and matplotlib is installed); returns the
    verdicts and crossovers (also stored in results.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = dict(results, order=[c for c in results["order"] if c in results["configs"]])
    if not results["order"]:
        raise RuntimeError(f"no configuration ran: {results.get('failed')}")
    verdicts = [verdict(results, label) for label in results["workloads"]]
    xs = sweep_crossovers(results)
    results = dict(results, verdicts=verdicts, crossovers=xs, command=command)
    made: dict[str, list[str]] = {}
    if plots:
        try:
            made = plot(results, out_dir)
        except ImportError:
            results["plots_skipped"] = ("matplotlib is not installed: .venv/bin/python -m pip install -c "
                                        "scripts/constraints.txt matplotlib")
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "report.md").write_text(markdown(results, verdicts, xs, made, command))
    return {"verdicts": verdicts, "crossovers": xs}


def rescore(src: Path, out: Path, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict[str, Any]:
    """Goodput at other targets, from a finished comparison's raw records: ``src``'s results with goodput and
    SLO attainment recomputed, written as a new report in ``out`` (its raw/ links to ``src``'s)."""
    import os

    from .metrics import SLO, goodput, record_from_dict

    results = json.loads((src / "results.json").read_text())
    slo = SLO(slo_ttft_ms, slo_tpot_ms)
    for c, cfg in results["configs"].items():
        for label, row in cfg["workloads"].items():
            p = src / "raw" / f"{c}__{slug(label)}.json"
            raw = json.loads(p.read_text())
            records = [record_from_dict(r) for r in raw["records"]]
            row.update(goodput(records, raw["wall_s"], slo))
    results["slo"] = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}
    results["rescored_from"] = str(src)
    for k in ("verdicts", "crossovers", "command"):
        results.pop(k, None)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "raw").exists():
        os.symlink(os.path.abspath(src / "raw"), out / "raw")
    return write_report(results, out, command=f"pdserve bench report {src} --slo-ttft-ms {slo_ttft_ms} "
                        f"--slo-tpot-ms {slo_tpot_ms} --out {out}")
