"""Prometheus text exposition, read side: one parser for every package that reads a /metrics page (the
router's load probe, the benchmark client)."""

from __future__ import annotations

import re

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


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


def label_values(key: str) -> dict[str, str]:
    """The labels of a ``name{a="b",...}`` key (as :func:`parse` returns with ``labels=True``)."""
    return dict(_LABEL.findall(key.partition("{")[2]))
