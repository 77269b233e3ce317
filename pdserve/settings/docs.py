"""The docs' option tables, generated from the table of settings.

A Markdown file marks each generated table with a pair of comments::

    <!-- settings: router failures short -->
    | flag | default | what it does |
    ...
    <!-- /settings -->

``settings:`` takes a process (launcher, router, conductor), optionally a group (the table's ``group``) and
``short`` (flag, default and help only). ``python -m pdserve.settings.docs FILE...`` rewrites the marked tables;
``--check`` only reports the files whose tables differ (``tests/unit/test_settings_docs.py`` runs it on the
committed docs).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from .spec import Setting, number_text
from .table import of
from .targets import settings_of

_REGION = re.compile(r"(<!-- settings: ([a-z_ ]+) -->\n)(.*?)(<!-- /settings -->)", re.S)


def _value(value: Any) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _allowed(s: Setting) -> str:
    if s.choices:
        return ", ".join(f"`{c}`" if c else "`\"\"`" for c in s.choices)
    if s.kind is bool:
        return "on / off"
    lo = "" if s.minimum is None else f"{'>' if s.above else '>='} {number_text(s.minimum)}"
    hi = "" if s.maximum is None else f"{'<' if s.below else '<='} {number_text(s.maximum)}"
    if s.kind is str:
        return "text"
    if s.kind is object:
        return "size (bytes or e.g. `1GiB`)"
    text = ", ".join(x for x in (lo, hi) if x) or "any"
    return text + (" or unset" if s.optional else "")


def _flag(s: Setting, process: str) -> str:
    if process == "conductor":
        return f"`{s.name}`"
    if s.kind is bool and s.off_flag:
        return f"`{s.cli_flag}` / `{s.off_flag}`" if s.flag else f"`{s.off_flag}`"
    if s.group == "connector":
        return f"`{s.name}` (connector_extra)"
    if not s.on_cli:
        return f"`{s.name}` (config file only)"
    return f"`{s.cli_flag}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(process: str, group: str = "", short: bool = False) -> str:
    """The table of ``process``'s settings (of one ``group`` when given), as Markdown."""
    rows = settings_of("conductor") if process == "conductor" else of(process)
    rows = tuple(s for s in rows if not group or s.group == group)
    if short:
        lines = ["| flag | default | what it does |", "|---|---|---|"]
        lines += [f"| {_flag(s, process)} | {_value(s.default_for(process))} | {_cell(s.help)} |" for s in rows]
    else:
        lines = ["| setting | default | unit | allowed | processes | what it does |", "|---|---|---|---|---|---|"]
        lines += [f"| {_flag(s, process)} | {_value(s.default_for(process))} | {s.unit or '-'} | "
                  f"{_cell(_allowed(s))} | {', '.join(s.processes)} | {_cell(s.help)} |" for s in rows]
    return "\n".join(lines) + "\n"


def refresh(text: str) -> str:
    """``text`` with every marked table regenerated."""
    def one(m: re.Match[str]) -> str:
        words = m.group(2).split()
        short = "short" in words
        words = [w for w in words if w != "short"]
        process, group = words[0], (words[1] if len(words) > 1 else "")
        return m.group(1) + markdown(process, group, short) + m.group(4)

    return _REGION.sub(one, text)


def regions(text: str) -> int:
    return len(_REGION.findall(text))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.settings.docs",
                                description="regenerate the docs' option tables from the table of settings")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--check", action="store_true", help="report stale tables, change nothing")
    a = p.parse_args(argv)
    stale = []
    for path in a.files:
        text = path.read_text()
        new = refresh(text)
        if new != text:
            stale.append(str(path))
            if not a.check:
                path.write_text(new)
    if stale:
        print(("stale: " if a.check else "rewrote: ") + ", ".join(stale))
    return 1 if stale and a.check else 0


if __name__ == "__main__":
    sys.exit(main())
