"""Which modules of a package read another module's underscored names, read from the source with ``ast``: what
tests/unit/test_private_names.py (none in pdserve/) and scripts/run_coupling.py use; the test's docstring says what
it covers."""

from __future__ import annotations

import ast
from pathlib import Path

from .import_graph import modules


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
