"""The router's command line as the launcher writes it, from the table's ``argv`` rules.

:func:`router_flags` turns values (by setting name) into ``python -m pdserve.router`` flags, in table order:
``always`` settings always, ``set`` ones when not None or empty, ``changed`` ones when not the router's
default. The router reads them back with the flags :mod:`.flags` builds from the same table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .spec import Setting
from .table import of


def flag_words(s: Setting, value: Any) -> list[str]:
    """The words that give ``s`` this value on the command line."""
    if s.kind is bool:
        if value == s.default_for("router"):
            return []
        return [s.off_flag] if not value else [s.cli_flag]
    return [s.cli_flag, str(value)]


def router_flags(values: Mapping[str, Any]) -> list[str]:
    """Flags for the router's settings named in ``values``, each as its ``argv`` rule says."""
    argv: list[str] = []
    for s in of("router"):
        if s.name not in values or not s.argv:
            continue
        value = values[s.name]
        if s.argv == "set" and (value is None or value == ""):
            continue
        if s.argv == "changed" and value == s.default_for("router"):
            continue
        argv += flag_words(s, value)
    return argv


def launcher_values_for_router(config: Any) -> dict[str, Any]:
    """The launcher's values of the settings the router gets too (host, port, policy, SLO targets, ...)."""
    return {s.name: getattr(config, s.name) for s in of("launcher") if "router" in s.processes}
