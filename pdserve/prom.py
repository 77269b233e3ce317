"""Prometheus text exposition, read side: one reader, on prometheus_client's parser, for every package that reads a
/metrics page (the router's load probe, the benchmark client, the drain hook)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _key(sample: Sample) -> str:
    if not sample.labels:
        return sample.name
    return sample.name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items()) + "}"


def families(text: str) -> Iterator[tuple[str, str, list[Sample]]]:
    """(family name, TYPE, samples) per metric family; a malformed line ends the reading there (what came before
    it is kept)."""
    try:
        for fam in text_string_to_metric_families(text):
            yield fam.name, fam.type, fam.samples
    except ValueError:
        return


def parse(text: str, prefix: str = "", labels: bool = False) -> dict[str, float]:
    """Sum of every sample per metric name, for names starting with ``prefix``; with ``labels`` the key keeps the
    label set (``name{a="b"}``, labels in the page's order), else labels are dropped and samples of one name are
    added up."""
    totals: dict[str, float] = {}
    for _, _, samples in families(text):
        for s in samples:
            if s.name.startswith(prefix):
                key = _key(s) if labels else s.name
                totals[key] = totals.get(key, 0.0) + float(s.value)
    return totals


def types(text: str) -> dict[str, str]:
    """Metric name -> TYPE as the page declares it (a counter under its ``_total`` sample name too)."""
    out: dict[str, str] = {}
    for name, typ, samples in families(text):
        out[name] = typ
        if typ == "counter":
            out.update({s.name: typ for s in samples if s.name == name + "_total"})
    return out


def label_values(key: str) -> dict[str, str]:
    """The labels of a ``name{a="b",...}`` key (as :func:`parse` returns with ``labels=True``)."""
    if "{" not in key:
        return {}
    for _, _, samples in families(key + " 0\n"):
        for s in samples:
            return dict(s.labels)
    return {}
