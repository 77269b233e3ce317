"""``pdserve plan --profile DIR``: the planner calibrated from a measured run, and its own error against that run.

``DIR`` is a ``pdserve bench compare --out DIR`` folder (``results.json`` and ``raw/CONFIG__WORKLOAD.json``, every
request's client-side record). For each configuration and workload in it:

1. **Calibrate** the cost model from that run's own requests (no probe of a live server; the same features and
   non-negative fit as :mod:`.calibrate`):

   - prefill: against its prompt length, each request's time from reaching the head of the queue to its first
     token (one worker computes every prompt: colocated1, 1PxD; vLLM's queue is first come first served, so the
     head is reached when the request before it had its first token), else the TTFT of each request that started
     with nothing waiting for its first token;
   - decode step: each request's median gap between streamed tokens after the second, against the requests
     decoding beside it at the middle of its decode (batch per worker and their context); where prompts run beside
     decodes (colocated, elastic) only the gaps clear of every prompt's computing (a gap spanning one is a step plus
     a prefill stall, which the simulator adds itself);
   - hand-off (PpDd): the median first -> second token gap less the median token gap.

2. **Simulate** the same requests (arrival times, prompt and output lengths) on the same shape (``colocatedN``,
   ``PpDd``, ``elasticN``) with that calibration (:mod:`.simulator`, the conductor policy the run used).

3. **Report** TTFT p50/p90, TPOT p50/p90 and output throughput (tokens/s over the run), measured and simulated,
   and the error (simulated - measured) / measured per figure.

What it cannot see: prefix sharing between prompts (the records keep lengths, not tokens: every prompt is simulated
as unshared, so a workload that shares prefixes is predicted slower than it ran), and what the run's machine did
besides (other load on the cores enters the calibration as it was during the run).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..settings.errors import ConfigError
from .calibrate import Calibration, fit
from .results import Targets, percentiles
from .simulator import Cluster, SimSettings, simulate
from .traffic import Request

FIGURES = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "output_tok_per_s")
_SHAPE = re.compile(r"^(?:colocated(?P<c>\d+)|elastic(?P<e>\d+)|(?P<p>\d+)p(?P<d>\d+)d)(?P<words>(-[a-z_]+)*)$")
CPU_CHUNK_TOKENS = 2048  # vLLM's CPU default max_num_batched_tokens (what `pdserve bench compare` runs unless set)


@dataclass
class MeasuredRun:
    """One configuration's run of one workload, as ``pdserve bench compare`` kept it."""

    config: str
    workload: str
    records: list[dict[str, Any]]  # RequestRecord.to_dict(): start_s, ttft_s, e2e_s, itl_s, prompt/output tokens


def load_runs(folder: str | Path) -> tuple[list[MeasuredRun], dict[str, Any]]:
    """Every (configuration, workload) run of a ``pdserve bench compare --out`` folder, and its settings."""
    root = Path(folder)
    path = root / "results.json"
    if not path.is_file():
        raise ConfigError(f"--profile {folder}: no results.json there; give the --out folder of a finished "
                          "`pdserve bench compare` run")
    results = json.loads(path.read_text())
    runs = []
    for config in results.get("order", []):
        for label in results.get("configs", {}).get(config, {}).get("workloads", {}):
            raw = root / "raw" / f"{config}__{_slug(label)}.json"
            if raw.is_file():
                runs.append(MeasuredRun(config, label, json.loads(raw.read_text())["records"]))
    if not runs:
        raise ConfigError(f"--profile {folder}: results.json lists no run with its raw records (raw/*.json)")
    return runs, results.get("settings", {})


def _slug(s: str) -> str:
    from ..bench.report import slug

    return slug(s)


def shape(config: str) -> tuple[Cluster, str]:
    """(simulated cluster, router policy) of a ``pdserve bench compare`` configuration name."""
    m = _SHAPE.match(config)
    if m is None:
        raise ConfigError(f"configuration {config!r}: the planner simulates colocatedN, elasticN and PpDd[-POLICY]")
    words = [w for w in (m.group("words") or "").split("-") if w]
    policy = next((w for w in words if w in ("conductor", "round_robin", "least_loaded")), "round_robin")
    if m.group("c"):
        return Cluster(colocated=int(m.group("c"))), policy
    if m.group("e"):
        return Cluster(elastic=int(m.group("e"))), "conductor"
    return Cluster(prefill=int(m.group("p")), decode=int(m.group("d"))), policy


def prefill_samples(recs: list[dict[str, Any]], one_queue: bool) -> list[tuple[int, float]]:
    """(prompt tokens, seconds computing it) from the run's requests, in start order. ``one_queue`` (one worker
    computes every prompt: colocated1, 1PxD): vLLM serves its waiting queue first come first served, so a request's
    prompt starts when it arrived or when the one before it had its first token, whichever is later, and every
    request gives a sample (an overloaded run has few requests that found the queue empty). Else only the requests
    that started with no other request waiting for its first token."""
    out: list[tuple[int, float]] = []
    prev_first = float("-inf")
    for r in recs:
        start, first = float(r["start_s"]), float(r["start_s"]) + float(r["ttft_s"])
        if one_queue:
            began = max(start, prev_first)
            if first > began:
                out.append((int(r["prompt_tokens"]), first - began))
            prev_first = max(prev_first, first)
        elif not any(o is not r and o["start_s"] < start < o["start_s"] + o["ttft_s"] for o in recs):
            out.append((int(r["prompt_tokens"]), float(r["ttft_s"])))
    return out


def prefill_windows(recs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(from, to) of each prompt's computing: from reaching the head of the queue (FCFS) to its first token."""
    out, prev_first = [], float("-inf")
    for r in recs:
        start, first = float(r["start_s"]), float(r["start_s"]) + float(r["ttft_s"])
        out.append((max(start, prev_first), first))
        prev_first = max(prev_first, first)
    return out


def clear_gaps(r: dict[str, Any], windows: list[tuple[float, float]]) -> list[float]:
    """The request's token gaps after its second token that overlap no prompt's computing in ``windows``."""
    itl = r.get("itl_s") or []
    t = float(r["start_s"]) + float(r["ttft_s"]) + (itl[0] if itl else 0.0)
    out = []
    for g in itl[1:]:
        if not any(a < t + g and t < b for a, b in windows):
            out.append(float(g))
        t += g
    return out


def _ok(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("ok") and r.get("ttft_s") is not None and r.get("e2e_s") is not None]


def requests_of(run: MeasuredRun) -> list[Request]:
    """The run's requests as the simulator takes them: sent at their start, with their lengths."""
    return [Request(f"r{i}", float(r["start_s"]), int(r["prompt_tokens"]), max(1, int(r["output_tokens"])))
            for i, r in enumerate(_ok(run.records))]


def calibrate_run(run: MeasuredRun, kv_bytes_per_token: int, bandwidth_bytes_s: float) -> Calibration:
    """The cost model fitted to the run's own requests (module docstring)."""
    recs = sorted(_ok(run.records), key=lambda r: r["start_s"])
    cluster, _ = shape(run.config)
    workers = max(1, cluster.colocated or cluster.decode or cluster.elastic)
    prefill = prefill_samples(recs, one_queue=(cluster.colocated or cluster.prefill) == 1)
    # where prompts run beside decodes (colocated, elastic), a gap that spans another prompt's computing is a decode
    # step plus a prefill stall, which the simulator adds itself: only the gaps clear of every prefill count
    stalls = prefill_windows(recs) if not cluster.prefill else []
    decode: list[tuple[int, int, float]] = []
    for r in recs:
        gaps = clear_gaps(r, stalls)
        if len(gaps) < 2:
            continue
        first, end = r["start_s"] + r["ttft_s"], r["start_s"] + r["e2e_s"]
        mid = (first + end) / 2
        beside = [o for o in recs if o["start_s"] + o["ttft_s"] <= mid < o["start_s"] + o["e2e_s"]]
        batch = max(1, round(len(beside) / workers))
        ctx = sum(int(o["prompt_tokens"]) + int(o["output_tokens"]) // 2 for o in beside) // workers
        decode.append((batch, max(1, ctx), statistics.median(gaps)))
    if len({n for n, _ in prefill}) < 2 or len(decode) < 2:
        raise ConfigError(f"{run.config} / {run.workload}: too few requests to calibrate from ({len(prefill)} "
                          f"started with nothing queued, {len(decode)} streamed 3+ tokens); run more requests or "
                          "a lower rate, with prompts of several lengths")
    cal = fit(prefill, decode, kv_bytes_per_token, bandwidth_bytes_s)
    if not any(cal.prefill_coef[1:]):
        raise ConfigError(f"{run.config} / {run.workload}: the run's prefill times do not grow with the prompt "
                          f"({len(prefill)} samples); run prompts of several lengths")
    if cluster.prefill:
        first_gaps = [r["itl_s"][0] for r in recs if r.get("itl_s")]
        later = [g for r in recs for g in (r.get("itl_s") or [])[1:]]
        if first_gaps and later:
            cal.handoff_s = max(0.0, statistics.median(first_gaps) - statistics.median(later))
    return cal


def measured_figures(run: MeasuredRun) -> dict[str, float | None]:
    recs = _ok(run.records)
    ttft = [float(r["ttft_s"]) for r in recs]
    tpot = [float(r["tpot_s"]) for r in recs if r.get("tpot_s") is not None]
    span = max((r["start_s"] + r["e2e_s"] for r in recs), default=0.0) - min((r["start_s"] for r in recs),
                                                                            default=0.0)
    tokens = sum(int(r["output_tokens"]) for r in recs)
    t, p = percentiles(ttft), percentiles(tpot)
    return {"ttft_p50": t["p50"], "ttft_p90": t["p90"], "tpot_p50": p["p50"], "tpot_p90": p["p90"],
            "output_tok_per_s": tokens / span if span > 0 else None}


def simulated_figures(run: MeasuredRun, cal: Calibration, chunk_tokens: int, kv_capacity_tokens: int
                      ) -> dict[str, float | None]:
    cluster, policy = shape(run.config)
    reqs = requests_of(run)
    sim = simulate(cluster, cal.cost_model(), SimSettings(Targets(1e9, 1e9), policy=policy, chunk_tokens=chunk_tokens,
                                                          kv_capacity_tokens=kv_capacity_tokens), reqs)
    return {"ttft_p50": sim["ttft_s"]["p50"], "ttft_p90": sim["ttft_s"]["p90"], "tpot_p50": sim["tpot_s"]["p50"],
            "tpot_p90": sim["tpot_s"]["p90"], "output_tok_per_s": sim["output_tps"] if sim["completed"] else None}


def errors(measured: dict[str, float | None], simulated: dict[str, float | None]) -> dict[str, float | None]:
    """(simulated - measured) / measured per figure (None where either is missing)."""
    out: dict[str, float | None] = {}
    for k in FIGURES:
        m, s = measured.get(k), simulated.get(k)
        out[k] = (s - m) / m if m and s is not None else None
    return out


def validate(folder: str | Path, kv_bytes_per_token: int, bandwidth_bytes_s: float) -> list[dict[str, Any]]:
    """One row per run of ``folder``: its calibration, measured and simulated figures, and the error."""
    runs, settings = load_runs(folder)
    chunk = int(settings.get("max_num_batched_tokens") or CPU_CHUNK_TOKENS)
    gib = float(settings.get("kv_cache_gib") or 1)
    capacity = max(1, int(gib * (1 << 30) / max(1, kv_bytes_per_token)))
    rows = []
    for run in runs:
        cal = calibrate_run(run, kv_bytes_per_token, bandwidth_bytes_s)
        meas = measured_figures(run)
        sim = simulated_figures(run, cal, chunk, capacity)
        rows.append({"config": run.config, "workload": run.workload, "requests": len(requests_of(run)),
                     "calibration": {"prefill_coef": cal.prefill_coef, "decode_coef": cal.decode_coef,
                                     "handoff_s": cal.handoff_s},
                     "measured": meas, "simulated": sim, "error": errors(meas, sim)})
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The error table: per run, measured / simulated / error of each figure (times in ms)."""
    head = f"{'config':>16} {'workload':>24} {'':>9} " + " ".join(f"{k:>16}" for k in FIGURES)
    out = [head]
    for r in rows:
        for kind in ("measured", "simulated", "error"):
            vals = []
            for k in FIGURES:
                v = r[kind].get(k)
                if v is None:
                    vals.append(f"{'-':>16}")
                elif kind == "error":
                    vals.append(f"{v:>+16.0%}")
                elif k == "output_tok_per_s":
                    vals.append(f"{v:>16.1f}")
                else:
                    vals.append(f"{v * 1e3:>16.1f}")
            name = (r["config"], r["workload"][:24]) if kind == "measured" else ("", "")
            out.append(f"{name[0]:>16} {name[1]:>24} {kind:>9} " + " ".join(vals))
    return out
