"""What the router hands on to the configs it builds inside its process (the conductor's, the moves'), with
the unit converted as the table's :class:`~pdserve.settings.spec.Target` says (a TPOT target in ms -> s)."""

from __future__ import annotations

from typing import Any

from .spec import Setting
from .table import SETTINGS, of


def handed_on(config: Any, target: str) -> dict[str, Any]:
    """Keyword arguments of config ``target`` (``conductor``, ``moves``) from the router config ``config``."""
    return {t.field: t.convert(getattr(config, s.name)) for s in of("router") for t in s.targets
            if t.config == target}


def settings_of(target: str) -> tuple[Setting, ...]:
    """The settings of config ``target`` under its own field names, units and defaults: those handed on to it
    and those only it has (the conductor's ``local_stall_s``, ...)."""
    out: list[Setting] = []
    for s in SETTINGS:
        mine = [t for t in s.targets if t.config == target]
        if mine:
            out.extend(s.for_target(t) for t in mine)
        elif s.processes == (target,):
            out.append(s)
    return tuple(out)


def target_default(target: str, field: str) -> Any:
    for s in settings_of(target):
        if s.name == field:
            return s.default
    raise KeyError(f"{target} has no setting {field!r}")
