"""Read counters from a Prometheus text endpoint (the workers' /metrics)."""

from __future__ import annotations

import urllib.request


def scrape(url: str, prefix: str = "", timeout_s: float = 5.0) -> dict[str, float]:
    """Sum of every sample per metric name (labels dropped), for names starting with ``prefix``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.startswith(prefix):
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return totals


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
