"""One request's run (pdserve/router/run/ and the fleet it calls) imports without circles, counting every import:
TYPE_CHECKING blocks and imports inside functions are edges too (issue 23: generation -> relay -> generation)."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "pdserve" / "router"


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROUTER.rglob("*.py"):
        parts = f.relative_to(ROUTER.parents[1]).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    t = sub if sub in mods else target
                    if t in mods and t != m:
                        edges[m].add(t)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return edges


def _reaches(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(edges[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges[m])
    return seen


def test_the_run_and_the_fleet_import_without_circles():
    mods = _modules()
    edges = _edges(mods)
    assert "pdserve.router.run.relay" in edges["pdserve.router.run.attempt"]  # the walk sees imports
    ours = [m for m in mods if m.startswith(("pdserve.router.run", "pdserve.router.fleet"))]
    circles = sorted(m for m in ours if m in _reaches(edges, m))
    assert circles == [], circles
