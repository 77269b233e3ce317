"""No module in pdserve/ reads another module's underscored names (issue 23, item 5; docs/architecture.md section 5).

Checked on the source with ``ast``; what it covers:

1. ``from m import _name`` where m is a pdserve module (relative or absolute): reported.
2. ``m._name`` where ``m`` is a pdserve module this module imported (``from . import m``, ``import pdserve.m as m``):
   reported.
3. ``x._name`` on any other object (``c._fits``, ``gen._waiter``, ``self.client._post``) where ``_name`` is defined in
   another pdserve module (a function, class or module variable, a class attribute or an attribute set on ``self`` /
   ``cls`` there) and nowhere in this one: reported. Not seen: a private name of another module that this module
   also defines for itself (the check cannot tell whose object ``x`` is), and ``self._name`` / ``cls._name`` /
   ``super()._name`` (a class's own members, inherited ones included).

Third-party privates (``os._exit``, torch's CUDA IPC calls) are not pdserve's names and are not reported.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_import_cycles import modules

ROOT = Path(__file__).resolve().parents[2]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own class."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, module and class variables, attributes it sets on
    ``self`` / ``cls``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
                    elif isinstance(leaf, ast.Attribute) and _own(leaf.value):
                        names.add(leaf.attr)
    return {n for n in names if _private(n)}


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def violations(root: Path, package: str) -> list[str]:
    known = modules(root, package)
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in known.items()}
    defs = {name: defined(tree) for name, tree in trees.items()}
    bad: list[str] = []
    for name, tree in trees.items():
        where = known[name].relative_to(root)
        others = set().union(*(d for m, d in defs.items() if m != name)) - defs[name]
        imported_modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(node, name, known[name].name == "__init__.py")
                if source != package and not source.startswith(package + "."):
                    continue
                for a in node.names:
                    if _private(a.name):
                        bad.append(f"{where}:{node.lineno}: from {source} import {a.name}")
                    elif f"{source}.{a.name}" in known:
                        imported_modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in known:
                        imported_modules.add(a.asname)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr) or _own(node.value):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in imported_modules:
                bad.append(f"{where}:{node.lineno}: {ast.unparse(node)} (a private name of module {node.value.id})")
            elif node.attr in others:
                bad.append(f"{where}:{node.lineno}: {ast.unparse(node)} (private to another module)")
    return sorted(set(bad))


def test_no_module_reads_another_modules_private_names() -> None:
    found = violations(ROOT, "pdserve")
    assert not found, "private names read across modules:\n" + "\n".join(found)


def test_the_checker_sees_private_reads(tmp_path: Path) -> None:
    """Negative control: each pattern above is reported; a module's use of its own privates, a class's use of its
    own and inherited members, and third-party privates are not."""
    pkg = tmp_path / "probe"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "owner.py": ("class Owner:\n    _limit = 3\n\n    def __init__(self):\n        self._placed = {}\n\n"
                     "    def _fits(self):\n        return self._placed\n\n\ndef _helper():\n    return 1\n"),
        "reader.py": ("import os\nfrom . import owner\nfrom .owner import Owner, _helper\n\n"
                      "def f(c: Owner):\n    os._exit(0)\n    return c._fits(), c._placed, owner._helper(), Owner._limit\n"),
        "child.py": ("from .owner import Owner\n\nclass Child(Owner):\n    def g(self):\n"
                     "        return self._placed, super()._fits()\n"),
        "mine.py": "class A:\n    def __init__(self):\n        self._x = 1\n\ndef h(other: A):\n    return other._x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert violations(tmp_path, "probe") == [
        "probe/reader.py:3: from probe.owner import _helper",
        "probe/reader.py:7: Owner._limit (private to another module)",
        "probe/reader.py:7: c._fits (private to another module)",
        "probe/reader.py:7: c._placed (private to another module)",
        "probe/reader.py:7: owner._helper (a private name of module owner)",
    ]
