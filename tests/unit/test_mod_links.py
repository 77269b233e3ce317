"""Every ``:mod:`` link in pdserve's docstrings names a module that exists (relative links resolved against the
module they are in), so a move or rename cannot leave a link pointing nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r":mod:`~?([.\w]+)`")


def dead_links(root: Path) -> list[str]:
    files = sorted((root / "pdserve").rglob("*.py"))
    known = set()
    for p in files:
        parts = p.relative_to(root).with_suffix("").parts
        known.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    bad = []
    for p in files:
        parts = p.relative_to(root).with_suffix("").parts
        package = list(parts[:-1])  # what a relative link starts from (a package's __init__: that package)
        for m in LINK.finditer(p.read_text()):
            ref = m.group(1)
            if ref.startswith("."):
                level = len(ref) - len(ref.lstrip("."))
                base = package[: len(package) - (level - 1)]
                target = ".".join(base + ([ref.lstrip(".")] if ref.lstrip(".") else []))
            else:
                target = ref
            if target.startswith("pdserve") and target not in known:
                bad.append(f"{p.relative_to(root)}: {m.group(0)} -> {target}")
    return bad


def test_every_mod_link_names_a_module() -> None:
    assert dead_links(ROOT) == []


def test_the_checker_sees_a_dead_link(tmp_path: Path) -> None:
    pkg = tmp_path / "pdserve" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "pdserve" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text('"""See :mod:`.a` and :mod:`..gone`."""\n')
    (pkg / "a.py").write_text('"""See :mod:`.b`, :mod:`pdserve.sub` and :mod:`os`."""\n')
    assert dead_links(tmp_path) == ["pdserve/sub/__init__.py: :mod:`..gone` -> pdserve.gone",
                                    "pdserve/sub/a.py: :mod:`.b` -> pdserve.sub.b"]
