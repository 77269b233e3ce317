"""Candidate configurations for a device budget, their simulated figures, the pick and why."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.conductor.cost_model import CostModel

from .simulator import Cluster, SimSettings, config_kind, simulate
from .traffic import Request

TIE = 0.03  # goodputs within 3% count as equal; then colocated (simpler), then the lower TPOT p99 wins


def candidates(budget_devices: int, devices_per_worker: int, all_sizes: bool = False, elastic: bool = False
               ) -> list[Cluster]:
    """Colocated xN, elastic xN (when ``elastic``) and every xPyD that fits the budget (by default only those
    using all N workers)."""
    n = budget_devices // devices_per_worker
    if n < 1:
        raise ValueError(f"a budget of {budget_devices} devices holds no instance of {devices_per_worker}")
    sizes = range(1, n + 1) if all_sizes else [n]
    out = []
    for k in sizes:
        out.append(Cluster(colocated=k, devices_per_worker=devices_per_worker))
        if elastic and k > 1:  # one elastic worker is one colocated worker
            out.append(Cluster(elastic=k, devices_per_worker=devices_per_worker))
        out += [Cluster(prefill=p, decode=k - p, devices_per_worker=devices_per_worker) for p in range(1, k)]
    return out


def parse_clusters(text: str, devices_per_worker: int) -> list[Cluster]:
    """``"colocated:2,elastic:2,1P1D,2P1D"`` (also ``colocatedx2``, ``elastic2``) -> clusters."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        shape = re.fullmatch(r"(colocated|elastic)\s*[:x]?\s*(\d+)", part, re.I)
        pd = re.fullmatch(r"(\d+)p(\d+)d", part, re.I)
        if shape:
            out.append(Cluster(**{shape[1].lower(): int(shape[2])}, devices_per_worker=devices_per_worker))
        elif pd:
            out.append(Cluster(prefill=int(pd[1]), decode=int(pd[2]), devices_per_worker=devices_per_worker))
        else:
            raise ValueError(f"configuration {part!r}: use colocated:N, elastic:N or xPyD (e.g. 2P1D)")
    return out


def evaluate(clusters: Sequence[Cluster], cost: CostModel, settings: SimSettings, requests: Sequence[Request]
             ) -> list[dict[str, Any]]:
    return [simulate(c, cost, settings, requests) for c in clusters]


def _tpot99(r: dict[str, Any]) -> float:
    v = r["tpot_s"]["p99"]
    return float("inf") if v is None else v


def rank(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best first: goodput (ties within 3%: colocated first, then lower TPOT p99), then the rest by goodput."""
    if not results:
        return []
    top = max(r["goodput_rps"] for r in results)
    tied = [r for r in results if r["goodput_rps"] >= top * (1 - TIE)]
    simple = {"colocated": 0, "pd": 1, "elastic": 1}  # colocated has the fewest moving parts
    best = min(tied, key=lambda r: (simple[config_kind(r["config"])], _tpot99(r), r["config"]))
    rest = sorted((r for r in results if r is not best), key=lambda r: (-r["goodput_rps"], _tpot99(r)))
    return [best, *rest]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms" if v >= 0.01 else f"{v * 1e3:.1f} ms"


def reason(ranked: Sequence[dict[str, Any]], requests: Sequence[Request]) -> str:
    """One sentence: why the first of ``ranked`` beats the best of the other fixed kind (colocated vs xPyD);
    an elastic pick is compared with both (:func:`elastic_summary` says why)."""
    best = ranked[0]
    kind = config_kind(best["config"])
    if kind == "elastic":
        return elastic_summary(ranked) or f"{best['config']} has the highest goodput ({best['goodput_rps']:.2f} req/s)"
    is_pd = kind == "pd"
    other = next((r for r in ranked[1:] if config_kind(r["config"]) == ("colocated" if is_pd else "pd")), None)
    prompts = sorted(r.prompt_tokens for r in requests)
    p90 = prompts[int(0.9 * (len(prompts) - 1))] if prompts else 0
    size = f"{p90 / 1000:.0f}K" if p90 >= 1000 else str(p90)
    if other is None:
        return f"{best['config']} has the highest goodput ({best['goodput_rps']:.2f} req/s)"
    g, go = best["goodput_rps"], other["goodput_rps"]
    t, to = _tpot99(best), _tpot99(other)
    if is_pd:
        ratio = to / t if t > 0 else float("inf")
        return (f"decode stalls behind {size}-token prefills (p90) on colocated workers: {best['config']} cuts "
                f"TPOT p99 {ratio:.1f}x ({_ms(to)} -> {_ms(t)}) for {g:.2f} vs {go:.2f} req/s goodput "
                f"({other['config']})")
    xfer = other.get("transfer", {}).get("mean_s")
    skipped = "" if xfer is None else f" and a {_ms(xfer)} KV transfer"
    return (f"prompts are short enough ({size} tokens p90) that prefills barely stall decodes: {best['config']} "
            f"keeps every device on both phases and skips the hand-off{skipped}"
            f", {g:.2f} vs {go:.2f} req/s goodput for the best split ({other['config']}: TPOT p99 {_ms(to)}, "
            f"colocated {_ms(t)})")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def _p(r: dict[str, Any], metric: str, p: str) -> float:
    v = r[metric][p]
    return float("inf") if v is None else float(v)


def _n(v: float) -> str:
    return "-" if v == float("inf") else f"{v * 1e3:.1f}" if v < 0.1 else f"{v * 1e3:.0f}"


def elastic_summary(ranked: Sequence[dict[str, Any]]) -> str | None:
    """What elastic roles do here, in two sentences: the best elastic configuration against the best fixed split
    and the best colocated one (goodput ratio, TPOT p99, TTFT p50/p99), then why, read off the figures
    (:func:`_why_vs_colocated`, :func:`_why_vs_split`). None when no elastic configuration was simulated."""
    pick = {k: next((r for r in ranked if config_kind(r["config"]) == k), None)
            for k in ("elastic", "pd", "colocated")}
    e, pd, co = pick["elastic"], pick["pd"], pick["colocated"]
    if e is None:
        return None
    d = e["decisions"]
    others = [r for r in (pd, co) if r is not None]
    fig = lambda r: (f"{_n(_p(r, 'tpot_s', 'p99'))} ms, TTFT p50/p99 {_n(_p(r, 'ttft_s', 'p50'))}/"  # noqa: E731
                     f"{_n(_p(r, 'ttft_s', 'p99'))} ms")
    head = (f"{e['config']} ({d['local']} requests colocated, {d['disaggregated']} split"
            + (f", {d['reject']} rejected" if d["reject"] else "") + f"): goodput {e['goodput_rps']:.2f} req/s"
            + "".join(f", {_ratio(e['goodput_rps'], r['goodput_rps'])} {r['config']}'s" for r in others)
            + f"; TPOT p99 {fig(e)}" + (" (" + "; ".join(f"{r['config']}: {fig(r)}" for r in others) + ")"
                                        if others else ""))
    why = (_why_vs_colocated(e, co) if co is not None else []) + (
        _why_vs_split(e, pd) if pd is not None and d["disaggregated"] else [])
    return head + "." + (" Why: " + "; ".join(why) + "." if why else "")


def _why_vs_colocated(e: dict[str, Any], co: dict[str, Any]) -> list[str]:
    """Long prompts split off the decoding workers, or not: TPOT p99 against colocated."""
    te, tc = _p(e, "tpot_s", "p99"), _p(co, "tpot_s", "p99")
    if e["decisions"]["disaggregated"] == 0:
        return ["no prompt was long enough to split, so the pool ran as colocated workers"]
    if te < 0.9 * tc:
        return [f"splitting long prompts keeps their prefills off the workers that decode them (TPOT p99 "
                f"{_n(tc)} ms colocated -> {_n(te)} ms)"]
    return [f"prefills still stall decodes on the elastic workers (TPOT p99 {_n(te)} vs {_n(tc)} ms colocated)"]


def _why_vs_split(e: dict[str, Any], pd: dict[str, Any]) -> list[str]:
    """Against the split: prefill bursts spread over the pool or piled on a few workers (TTFT, and where the split
    prefills ran), more requests within the targets, decodes that still share steps with prefills and the
    hand-off each split pays (TPOT)."""
    why = []
    n_workers = int(e["config"].split("x")[-1])
    n_p = pd["config"].split("P")[0]
    split = e.get("split_prefills") or {}
    top_w, top_n = max(split.items(), key=lambda kv: (kv[1], kv[0]), default=("", 0))
    total = sum(split.values())
    piled = (f"; the conductor sends split prefills to the workers with the fewest decodes to stall, so they "
             f"queue there ({top_w} prefilled {top_n} of {total}, an even share is {total / n_workers:.0f})"
             if total and top_n > 2 * total / n_workers else "")
    t50, t99, tp50, tp99 = (_p(r, "ttft_s", q) for r, q in ((e, "p50"), (e, "p99"), (pd, "p50"), (pd, "p99")))
    if t99 < 0.9 * tp99:
        why.append(f"prefill bursts spread over all {n_workers} workers instead of {pd['config']}'s {n_p} "
                   f"prefill worker(s) (TTFT p99 {_n(tp99)} -> {_n(t99)} ms){piled}")
    elif t50 < 0.9 * tp50:
        why.append(f"all {n_workers} workers prefill, so the typical request starts sooner than on "
                   f"{pd['config']}'s {n_p} prefill worker(s) (TTFT p50 {_n(t50)} vs {_n(tp50)} ms), but the tail "
                   f"queues (TTFT p99 {_n(t99)} vs {_n(tp99)} ms){piled}")
    else:
        why.append(f"the pool absorbs prefill bursts no better than {pd['config']}'s prefill workers (TTFT p99 "
                   f"{_n(t99)} vs {_n(tp99)} ms){piled}")
    if e["goodput_rps"] > (1 + TIE) * pd["goodput_rps"] and t99 > tp99:
        why.append(f"yet more requests meet both targets ({e['slo_attainment']:.0%} vs "
                   f"{pd['slo_attainment']:.0%}): the queueing falls on the longest prompts, which the "
                   "placement sends where they stall the fewest decodes, while shorter ones take the free workers")
    te, tpp = _p(e, "tpot_s", "p99"), _p(pd, "tpot_s", "p99")
    if te > 1.1 * tpp:
        xfer = e.get("transfer")
        pays = "" if not xfer else (f"; each split also pays a {_n(xfer['mean_s'])} ms KV transfer + "
                                    f"{_n(xfer['handoff_s'])} ms hand-off")
        why.append(f"decodes on elastic workers still share steps with prefills, which {pd['config']}'s decode "
                   f"workers never do (TPOT p99 {_n(te)} vs {_n(tpp)} ms){pays}")
    return why


def sweep(clusters: Sequence[Cluster], cost: CostModel, settings: SimSettings,
          make_requests: Callable[[float], Sequence[Request]], rates: Sequence[float]
          ) -> dict[str, list[tuple[float, float]]]:
    """Goodput vs offered rate, per configuration."""
    out: dict[str, list[tuple[float, float]]] = {c.label: [] for c in clusters}
    for rate in rates:
        reqs = make_requests(rate)
        for c in clusters:
            out[c.label].append((rate, simulate(c, cost, settings, reqs)["goodput_rps"]))
    return out
