"""The figures a configuration matrix reports beyond :func:`pdserve.bench.metrics.summarize`: the hand-off percentiles
of the requests that were split P -> D, the machine's load average during a run, and
the goal ratios of an elastic configuration against the fixed ones measured in the same run.

Goals: elastic against the best colocated configuration (highest goodput) on the mixed workload:
TPOT p99 <= 0.5x, TTFT p50 <= 1.5x, goodput >= 1.2x; and on every workload, elastic's goodput >= 0.95x the
better of the "fixed" references (by default colocated2 and 1p1d).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .metrics import RequestRecord, percentiles

# (measure, bound, "max" = ratio must be <= bound, "min" = ratio must be >= bound)
MIXED_GOALS: tuple[tuple[str, float, str], ...] = (("tpot_p99_ms", 0.5, "max"), ("ttft_p50_ms", 1.5, "max"),
                                                   ("goodput_req_per_s", 1.2, "min"))
FIXED_GOODPUT_FLOOR = 0.95


def handoff_stats(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """p50/p99 of the router's ``handoff_ms`` (P's answer -> D's first token) over the successful requests that
    were split (their timings carry a hand-off); ``split_requests`` counts them, ``timed_requests`` counts every
    request with timings. Percentiles are None when nothing was split."""
    timed = [r.timings for r in records if r.ok and r.timings]
    vals = [float(t["handoff_ms"]) for t in timed if t.get("handoff_ms") is not None]
    pct = percentiles(vals, (50, 99))
    return {"timed_requests": len(timed), "split_requests": len(vals),
            "handoff_p50_ms": None if pct[50] is None else round(pct[50], 2),
            "handoff_p99_ms": None if pct[99] is None else round(pct[99], 2)}


def decode_spread(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Where the successful requests decoded (the router's ``decode_worker``): ``decodes_per_worker`` as counts,
    largest first, and ``short_split`` / ``long_split``: how many prompts under / at least ``long_tokens`` (500)
    were split P -> D (their timings name a prefill worker)."""
    timed = [r for r in records if r.ok and r.timings]
    per: dict[str, int] = {}
    for r in timed:
        w = (r.timings or {}).get("decode_worker")
        if w:
            per[w] = per.get(w, 0) + 1
    split = [r.prompt_tokens for r in timed if (r.timings or {}).get("prefill_worker")]
    return {"decodes_per_worker": sorted(per.values(), reverse=True),
            "short_split": sum(n < LONG_TOKENS for n in split), "long_split": sum(n >= LONG_TOKENS for n in split)}


LONG_TOKENS = 500  # a prompt this long or longer counts as "long" in decode_spread (the mixed workload: ~100 / ~1.5K)


def parse_loadavg(text: str) -> float:
    """The 1-minute load average from a ``/proc/loadavg`` line (``"2.35 1.83 1.81 5/168 5553"`` -> 2.35)."""
    try:
        return float(text.split()[0])
    except (IndexError, ValueError) as e:
        raise ValueError(f"not a /proc/loadavg line: {text!r}") from e


def _read_proc_loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read()


@dataclass
class LoadSampler:
    """Samples the 1-minute load average every ``period_s`` in a daemon thread: ``[(monotonic s, load1)]``.

    Use as a context manager around the whole run; :meth:`window` summarizes the samples of one workload."""

    period_s: float = 5.0
    read: Callable[[], str] = _read_proc_loadavg
    clock: Callable[[], float] = time.monotonic
    samples: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        try:
            self.samples.append((self.clock(), parse_loadavg(self.read())))
        except (OSError, ValueError):
            pass  # no /proc (not Linux): the load is missing from the report, not fatal

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def __enter__(self) -> LoadSampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="loadavg", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.period_s + 1.0)
        self.sample()

    def window(self, t0: float, t1: float) -> dict[str, float | int | None]:
        """Mean and max of the samples taken in ``[t0, t1]``."""
        vals = [v for t, v in self.samples if t0 <= t <= t1]
        return {"load1_mean": round(sum(vals) / len(vals), 2) if vals else None,
                "load1_max": round(max(vals), 2) if vals else None, "load_samples": len(vals)}

    def series(self, every_s: float = 30.0) -> list[tuple[float, float]]:
        """The samples thinned to one per ``every_s`` (seconds from the first sample), for the JSON line."""
        if not self.samples:
            return []
        t_first = self.samples[0][0]
        out: list[tuple[float, float]] = []
        for t, v in self.samples:
            if not out or t - t_first - out[-1][0] >= every_s:
                out.append((round(t - t_first, 1), v))
        return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _min_met(a: float | None, b: float | None, bound: float) -> bool | None:
    """``a >= bound * b``, also when ``b`` is 0 (then there is no ratio): a positive ``a`` meets it, and 0
    meets a floor (bound <= 1: not worse) but not a gain (bound > 1)."""
    if a is None or b is None:
        return None
    return a >= bound * b if b > 0 else (a > 0 or bound <= 1.0)


def best_by_goodput(results: dict[str, dict[str, Any]], configs: Iterable[str], workload: str) -> str | None:
    """The configuration among ``configs`` with the highest goodput on ``workload`` (ties: lower TPOT p99)."""
    have = [c for c in configs if workload in results.get(c, {})]
    if not have:
        return None

    def key(c: str) -> tuple[float, float]:
        r = results[c][workload]
        return (r.get("goodput_req_per_s") or 0.0, -(r.get("tpot_p99_ms") or float("inf")))

    return max(have, key=key)


def elastic_goals(results: dict[str, dict[str, Any]], elastic: str, mixed: str,
                  colocated: Iterable[str], fixed: Iterable[str]) -> dict[str, Any]:
    """Issue 16's goal ratios for ``elastic``. ``results[config][workload]`` is a summary with
    ``tpot_p99_ms``, ``ttft_p50_ms``, ``goodput_req_per_s``. Returns the mixed-workload ratios against the best
    colocated configuration with a met flag per goal, and per workload elastic's goodput against the better of
    ``fixed``; a goal whose figures are missing has ``met`` None (a baseline goodput of 0 has no ratio but
    still decides ``met``: see :func:`_min_met`)."""
    colocated, fixed = list(colocated), list(fixed)
    out: dict[str, Any] = {"elastic": elastic, "mixed_workload": mixed}
    base = best_by_goodput(results, colocated, mixed)
    mixed_goals: dict[str, Any] = {"baseline": base}
    e = results.get(elastic, {}).get(mixed)
    for measure, bound, sense in MIXED_GOALS:
        a, b = (e.get(measure), results[base][mixed].get(measure)) if e and base else (None, None)
        r = _ratio(a, b)
        met = (None if r is None else r <= bound) if sense == "max" else _min_met(a, b, bound)
        mixed_goals[measure] = {"ratio": r, "bound": bound, "sense": sense, "met": met}
    out["mixed_vs_best_colocated"] = mixed_goals
    per_wl: dict[str, Any] = {}
    for wl in results.get(elastic, {}):
        ref = best_by_goodput(results, fixed, wl)
        a = results[elastic][wl].get("goodput_req_per_s")
        b = results[ref][wl].get("goodput_req_per_s") if ref else None
        per_wl[wl] = {"baseline": ref, "goodput_ratio": _ratio(a, b), "bound": FIXED_GOODPUT_FLOOR,
                      "met": _min_met(a, b, FIXED_GOODPUT_FLOOR)}
    out["goodput_vs_better_fixed"] = per_wl
    flags = [g["met"] for g in mixed_goals.values() if isinstance(g, dict)] + [g["met"] for g in per_wl.values()]
    out["all_met"] = None if any(f is None for f in flags) or not flags else all(flags)
    return out


def parse_proc_stat(text: str) -> tuple[float, float]:
    """(busy, total) jiffies from the aggregate ``cpu`` line of ``/proc/stat`` (idle and iowait are not busy)."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            vals = [float(x) for x in parts[1:9]]
            total = sum(vals)
            return total - vals[3] - (vals[4] if len(vals) > 4 else 0.0), total
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def _read_proc_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def cpu_busy(interval_s: float = 3.0, read: Callable[[], str] = _read_proc_stat,
             sleep: Callable[[float], None] = time.sleep) -> float | None:
    """The machine's busy fraction (all cores) over ``interval_s``; None without ``/proc/stat``."""
    try:
        b0, t0 = parse_proc_stat(read())
        sleep(interval_s)
        b1, t1 = parse_proc_stat(read())
    except (OSError, ValueError):
        return None
    return round((b1 - b0) / (t1 - t0), 3) if t1 > t0 else None


def wait_for_quiet(max_busy: float, max_wait_s: float, busy: Callable[[], float | None] = cpu_busy,
                   clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Wait (up to ``max_wait_s``) until the machine is at most ``max_busy`` busy, so a measurement on a shared
    machine starts in a quiet moment when there is one; returns how long it waited and the last busy fraction."""
    t0 = clock()
    last = busy()
    while last is not None and last > max_busy and clock() - t0 < max_wait_s:
        last = busy()
    return {"quiet_wait_s": round(clock() - t0, 1), "busy_at_start": last,
            "quiet": None if last is None else last <= max_busy}
