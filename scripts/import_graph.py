"""The import graph of a package, read from its source with ``ast``, and its circles: what
tests/unit/test_import_cycles.py (no circles in pdserve/), test_router_layers.py and scripts/run_coupling.py use.

Every ``import`` / ``from ... import`` in a module is an edge, wherever it stands: at module level, inside a function
(a deferred import that only hides a circle still counts) and under ``if TYPE_CHECKING:``. Relative imports are
resolved against the importing module's package; ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module, else to ``pkg`` (its ``__init__``); ``import a.b.c`` is an edge to ``a.b.c``. Imports outside pdserve are
ignored. Not counted: the implicit import of a module's parent packages (``import a.b`` runs ``a/__init__.py``
first), which would make every package whose ``__init__`` re-exports its modules a circle with each of them.

A circle is reported as a path, ``a -> b -> ... -> a``, starting at its first module by name: for each module on a
circle, the shortest circle through it (so every module of a tangle of circles is named at least once).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root/package`` (a package is named by its __init__)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The dotted names one import statement in module ``name`` reaches (submodules resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` that ``name`` is, or is inside of (``a.b.C`` -> ``a.b``); None outside."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every import statement anywhere in its source."""
    known = modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, name, path.name == "__init__.py", known):
                    if target == package or target.startswith(package + "."):
                        owner = _owner(target, known)
                        if owner is not None and owner != name:
                            edges.add(owner)
        graph[name] = edges
    return graph


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start through ``within`` (breadth first)."""
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & within):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle within {sorted(within)}")


def cycles(root: Path, package: str) -> list[str]:
    """One line per import circle, as a path from its first module (by name): for every module on a circle, the
    shortest circle through it (each listed once), so that every module of a tangle is named."""
    graph = import_graph(root, package)
    out: list[str] = []
    for comp in components(graph):
        for module in comp:
            path = shortest_cycle(graph, module, set(comp))[:-1]
            first = path.index(min(path))
            line = " -> ".join(path[first:] + path[:first] + [min(path)])
            if line not in out:
                out.append(line)
    return out
