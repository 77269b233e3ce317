"""What one setting is: its name, type, unit, default, range or choices, help, and which processes get it.

A :class:`Setting` is declared once, in :data:`pdserve.settings.table.SETTINGS`; the configs check their values
with :meth:`Setting.check`, the command lines are built from it (:mod:`.flags`), the launcher writes the
router's argv from it (:mod:`.argv`), the router hands values on to the conductor through its
:class:`Target` (with the unit converted, :mod:`.targets`) and the docs' option tables are generated from it
(:mod:`.docs`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .errors import ConfigError

PROCESSES = ("launcher", "router", "conductor", "worker", "pool", "indexer", "picker")
ARGV_RULES = ("", "always", "set", "changed")  # how the launcher writes a setting into the router's argv
UNIT_WORDS = {"s": "seconds", "ms": "ms"}


@dataclass(frozen=True)
class Target:
    """Where the router hands a setting on inside its process: field ``field`` of the config ``config``
    (``conductor``: :class:`~pdserve.conductor.config.ConductorConfig`; ``moves``:
    :class:`~pdserve.conductor.moves.MoveConfig`), the value divided by ``per`` into ``unit`` (ms -> s: 1000).
    ``default``: that config's own default when it is built without the router (the simulator, tests)."""

    config: str
    field: str
    per: float = 1.0
    unit: str = ""
    default: Any = ...

    def convert(self, value: Any) -> Any:
        """The value in the target's unit: divided by ``per`` (ms -> s: 1000)."""
        if value is None or self.per == 1.0:
            return value
        return value / self.per


@dataclass(frozen=True)
class Setting:
    """One setting. ``kind``: bool, int, float or str (a float setting takes ints too); object: a value its
    config parses itself (a size such as ``1GiB`` or a byte count). ``optional``: None means unset.
    ``minimum`` / ``maximum`` bound numbers, or a string's length (``above`` / ``below``: the bound itself is
    not allowed). ``advice``: what the error message says after ``label=value:`` (``{unit}``, ``{lo}``,
    ``{hi}`` are filled in; the default advice is made from the range). ``flag``: the command-line flag
    (default ``--name``, dashes); ``off_flag``: a bool's flag that turns it off; ``on_cli``: False keeps it off
    the command line (a config file or the library only). ``zero_is_none``: ``0`` on the command line means
    None (no limit). ``group``: its section in ``--help`` and the docs. ``argv``: how the launcher writes it
    into the router's argv: ``always``, ``set`` (not None or empty), ``changed`` (not the router's default) or
    ``""`` (never). ``targets``: where the router hands it on (:class:`Target`). ``defaults``: another
    default in some processes, as ``((process, value), ...)``."""

    name: str
    kind: type
    default: Any
    help: str
    processes: tuple[str, ...]
    unit: str = ""
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False
    below: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False
    advice: str = ""
    flag: str = ""
    off_flag: str = ""
    metavar: str = ""
    zero_is_none: bool = False
    on_cli: bool = True
    group: str = ""
    argv: str = ""
    targets: tuple[Target, ...] = ()
    defaults: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        bad = set(self.processes) - set(PROCESSES)
        if bad or self.argv not in ARGV_RULES or self.kind not in (bool, int, float, str, object):
            raise ValueError(f"setting {self.name}: processes {sorted(bad)}, argv {self.argv!r}, kind {self.kind}")

    # ------------------------------------------------------------------ names

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def default_for(self, process: str) -> Any:
        return dict(self.defaults).get(process, self.default)

    def for_target(self, target: Target) -> Setting:
        """This setting as the config behind ``target`` sees it: its field name, unit and default."""
        return replace(self, name=target.field, unit=target.unit or self.unit, targets=(), defaults=(),
                       default=self.default if target.default is ... else target.default,
                       minimum=target.convert(self.minimum), maximum=target.convert(self.maximum))

    # ------------------------------------------------------------------ checking

    def valid(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.kind is object:
            return True
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False
        if self.kind is str:  # minimum: the shortest allowed length
            return isinstance(value, str) and (not self.choices or value in self.choices) \
                and len(value) >= (self.minimum or 0)
        if self.kind is int and not isinstance(value, int):
            return False
        if self.kind is float and (not isinstance(value, (int, float)) or math.isnan(value)):
            return False
        if self.minimum is not None and (value <= self.minimum if self.above else value < self.minimum):
            return False
        return self.maximum is None or (value < self.maximum if self.below else value <= self.maximum)

    def check(self, value: Any, label: str = "", error: type[Exception] = ConfigError, sep: str = "=") -> None:
        """Raise ``error("label=value: advice")`` unless ``value`` is allowed (``label`` default: the name;
        ``sep`` " " for a flag: ``--port 70000: ...``)."""
        if not self.valid(value):
            raise error(f"{label or self.name}{sep}{value!r}: {self.message()}")

    def message(self) -> str:
        unit = UNIT_WORDS.get(self.unit, self.unit)
        if self.advice:
            return self.advice.format(unit=unit, lo=number_text(self.minimum), hi=number_text(self.maximum))
        if self.choices:
            return f"choose one of {', '.join(self.choices)}"
        if self.kind is bool:
            return "true or false"
        what = {int: "a whole number", float: "a number"}.get(self.kind, "a string")
        if self.kind is not str and unit:
            what += f" of {unit}"
        if self.minimum is not None and self.maximum is not None:
            what += f" from {number_text(self.minimum)} to {number_text(self.maximum)}"
            what += " (exclusive)" if self.below else ""
        elif self.minimum is not None:
            what += f" {'>' if self.above else '>='} {number_text(self.minimum)}"
        return what + (", or unset" if self.optional else "")


def number_text(x: float | None) -> str:
    """A bound as the messages and docs write it: 16, 0.05, 1099511627776."""
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def check_fields(obj: Any, settings: tuple[Setting, ...], error: type[Exception] = ConfigError,
                 flags: bool = False) -> None:
    """Check every setting in ``settings`` on ``obj`` (an attribute each), named in a message by its name, or
    with ``flags`` by its command-line flag (``--port 70000: ...``)."""
    for s in settings:
        if flags:
            s.check(getattr(obj, s.name), s.cli_flag, error, sep=" ")
        else:
            s.check(getattr(obj, s.name), s.name, error)


def write_resolved(config: Any, values: Mapping[str, Any]) -> None:
    """Write a frozen config's derived values (what was given, normalised: a default that depends on another
    field, a list as a tuple, a secret from the environment) from its ``__post_init__``. The one place a frozen
    config (the launcher's, the router's, the pool's, the Kubernetes sidecars') changes after construction, and
    the one ``object.__setattr__`` of pdserve: a frozen dataclass has no other way to write its own field."""
    for name, value in values.items():
        object.__setattr__(config, name, value)
