"""Read counters from a Prometheus text endpoint (the workers' and the router's /metrics)."""

from __future__ import annotations

import urllib.request


def parse(text: str, prefix: str = "", labels: bool = False) -> dict[str, float]:
    """Sum of every sample per metric name, for names starting with ``prefix``; with ``labels`` the key keeps the
    label set (``name{a="b"}``), else labels are dropped and samples of one name are added up."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels if labels else name_labels.split("{", 1)[0]
        if name.startswith(prefix):
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return totals


def scrape(url: str, prefix: str = "", timeout_s: float = 5.0, labels: bool = False) -> dict[str, float]:
    """:func:`parse` applied to ``url``/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    return parse(text, prefix, labels)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
