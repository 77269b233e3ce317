"""Read counters from a Prometheus text endpoint (the workers' and the router's /metrics)."""

from __future__ import annotations

import urllib.request

from ..prom import parse

__all__ = ["delta", "parse", "scrape"]


def scrape(url: str, prefix: str = "", timeout_s: float = 5.0, labels: bool = False) -> dict[str, float]:
    """:func:`parse` applied to ``url``/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    return parse(text, prefix, labels)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
