"""Candidate configurations for a device budget, their simulated figures, the pick and why."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.conductor.cost_model import CostModel

from .simulator import Cluster, SimSettings, simulate
from .traffic import Request

TIE = 0.03  # goodputs within 3% count as equal; then colocated (simpler), then the lower TPOT p99 wins


def candidates(budget_devices: int, devices_per_worker: int, all_sizes: bool = False) -> list[Cluster]:
    """Colocated xN and every xPyD that fits the budget (by default only those using all N workers)."""
    n = budget_devices // devices_per_worker
    if n < 1:
        raise ValueError(f"a budget of {budget_devices} devices holds no instance of {devices_per_worker}")
    sizes = range(1, n + 1) if all_sizes else [n]
    out = []
    for k in sizes:
        out.append(Cluster(colocated=k, devices_per_worker=devices_per_worker))
        out += [Cluster(prefill=p, decode=k - p, devices_per_worker=devices_per_worker) for p in range(1, k)]
    return out


def parse_clusters(text: str, devices_per_worker: int) -> list[Cluster]:
    """``"colocated:2,1P1D,2P1D"`` (also ``colocatedx2``) -> clusters."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        colo = re.fullmatch(r"colocated\s*[:x]?\s*(\d+)", part, re.I)
        pd = re.fullmatch(r"(\d+)p(\d+)d", part, re.I)
        if colo:
            out.append(Cluster(colocated=int(colo[1]), devices_per_worker=devices_per_worker))
        elif pd:
            out.append(Cluster(prefill=int(pd[1]), decode=int(pd[2]), devices_per_worker=devices_per_worker))
        else:
            raise ValueError(f"configuration {part!r}: use colocated:N or xPyD (e.g. 2P1D)")
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
    best = min(tied, key=lambda r: (not r["config"].startswith("colocated"), _tpot99(r), r["config"]))
    rest = sorted((r for r in results if r is not best), key=lambda r: (-r["goodput_rps"], _tpot99(r)))
    return [best, *rest]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms" if v >= 0.01 else f"{v * 1e3:.1f} ms"


def reason(ranked: Sequence[dict[str, Any]], requests: Sequence[Request]) -> str:
    """One sentence: why the first of ``ranked`` beats the best of the other kind."""
    best = ranked[0]
    is_pd = not best["config"].startswith("colocated")
    other = next((r for r in ranked[1:] if r["config"].startswith("colocated") == is_pd), None)
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
