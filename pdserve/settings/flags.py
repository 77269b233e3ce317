"""Command-line flags from the table: ``pdserve serve`` (the launcher) and ``python -m pdserve.router``.

:func:`add_flags` adds one flag per setting the process gets (in table order, grouped as the table groups
them); :func:`values_from_args` reads them back as config keyword arguments (``0`` -> None where the table
says so).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from .spec import Setting
from .table import of

GROUP_TITLES = {
    "placement": "placement (pdserve.conductor)",
    "failures": "failures and overload",
    "gpus": "GPUs and the KV data plane (docs/gpu.md)",
    "pool": "the KV pool (docs/store.md)",
    "lora": "LoRA adapters (multi-LoRA through P and D)",
    "supervision": "supervision (restarts, timeouts)",
    "indexer": "the KV indexer service (docs/indexer.md)",
    "picker": "the endpoint picker (docs/picker.md)",
    "observability": "tracing (OpenTelemetry, docs/observability.md)",
}


def non_negative_int(text: str) -> int:
    """argparse type of the launcher's whole-number flags: an integer >= 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def _help(s: Setting, default: Any) -> str:
    if default is None or default == "" or s.kind is bool:
        return s.help
    unit = f" {s.unit}" if s.unit and s.unit not in ("tokens", "bytes") else ""
    return f"{s.help} (default {default}{unit})"


def add_flags(parser: argparse.ArgumentParser, process: str, suppress: bool = False,
              int_type: Callable[[str], int] = int, skip: tuple[str, ...] = ()) -> None:
    """One flag per setting of ``process`` on the command line. ``suppress``: a flag not given leaves no
    attribute (a config file then supplies it); else its default is the table's for ``process``."""
    groups: dict[str, Any] = {}
    for s in of(process):
        if not s.on_cli or s.name in skip:
            continue
        title = GROUP_TITLES.get(s.group)
        if title and s.group not in groups:
            groups[s.group] = parser.add_argument_group(title)
        where = groups.get(s.group, parser)
        default = s.default_for(process)
        given = argparse.SUPPRESS if suppress else default
        if s.kind is bool:
            if s.flag or not s.off_flag:
                where.add_argument(s.cli_flag, dest=s.name, action="store_true", default=given, help=s.help)
            if s.off_flag:
                where.add_argument(s.off_flag, dest=s.name, action="store_false", default=given,
                                   help=f"turn off: {s.help}" if s.flag else f"do not {s.help} (default: do)")
            continue
        kw: dict[str, Any] = {"dest": s.name, "default": given, "help": _help(s, default)}
        if s.kind is int:
            kw["type"] = int_type
        elif s.kind is float:
            kw["type"] = float
        if s.choices:
            kw["choices"] = s.choices
        if s.metavar:
            kw["metavar"] = s.metavar
        where.add_argument(s.cli_flag, **kw)


def values_from_args(args: argparse.Namespace | Mapping[str, Any], process: str) -> dict[str, Any]:
    """The values of ``process``'s settings given on the command line, as config keyword arguments."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    out: dict[str, Any] = {}
    for s in of(process):
        if s.name in given:
            value = given[s.name]
            out[s.name] = None if s.zero_is_none and value == 0 else value
    return out
