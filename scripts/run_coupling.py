"""How coupled one request's run is (issue 23's measure): its files, the import edges and circles between them, the
public names they import from each other, and the private names they read across modules (the same checker as
tests/unit/test_private_names.py: scripts/private_names.py).

    .venv/bin/python scripts/run_coupling.py                    # this tree: pdserve/router/run/ and fleet/move.py
    .venv/bin/python scripts/run_coupling.py --root DIR --before  # a tree from before the split (e.g. `git archive
                                                                  # 76468ae^ | tar -x -C DIR`): the flat router's files
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from scripts.import_graph import components, import_graph, modules  # noqa: E402
from scripts.private_names import _private, _resolve, violations  # noqa: E402

# the run of one request before the router's split (76468ae^): Generation, its mixins, its subclass and helpers
BEFORE = ("handoff", "expiry", "move", "choices", "relay", "delta", "stops", "failures", "deadline", "timings",
          "answer", "kv_protocol")


def _imports(known: dict[str, Path], name: str) -> list[tuple[str, str | None]]:
    """(module imported, name imported from it or None for a module) for each ``from ... import`` in ``name``."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(known[name].read_text())):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(node, name, known[name].name == "__init__.py")
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.append((sub, None) if sub in known else (src, a.name))
    return out


def report(root: Path, run: set[str]) -> dict:
    known = modules(root, "pdserve")
    missing = run - set(known)
    if missing:
        raise SystemExit(f"not in {root}: {sorted(missing)}")
    graph = import_graph(root, "pdserve")
    edges = {m: graph[m] & run for m in run}
    circled = sorted(m.rsplit(".", 1)[1] for comp in components(edges) for m in comp)
    public = {(m, t, n) for m in run for t, n in _imports(known, m) if t in run and t != m and n and not _private(n)}
    files = {str(known[m].relative_to(root)) for m in run}
    private = [v for v in violations(root, "pdserve") if v.split(":")[0] in files]
    return {"files": sorted(files), "lines": sum(len(known[m].read_text().splitlines()) for m in run),
            "import_edges": sum(map(len, edges.values())),
            "on_a_circle": circled,
            "public_names_imported": len(public), "distinct_public_names": len({n for *_, n in public}),
            "private_names_read": private}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(HERE), help="the source tree (default: this one)")
    ap.add_argument("--before", action="store_true", help="the tree has the flat router (before the split)")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    if args.before:
        run = {f"pdserve.router.{m}" for m in BEFORE}
    else:
        run = {f"pdserve.router.run.{p.stem}" for p in (root / "pdserve/router/run").glob("*.py")
               if p.stem != "__init__"} | {"pdserve.router.fleet.move"}
    r = report(root, run)
    print(f"{len(r['files'])} files, {r['lines']} lines: {', '.join(r['files'])}")
    print(f"import edges between them {r['import_edges']}; modules on an import circle: {r['on_a_circle'] or 'none'}")
    print(f"public names imported between them: {r['public_names_imported']} "
          f"({r['distinct_public_names']} distinct)")
    print(f"private names read across modules: {len(r['private_names_read'])}")
    for v in r["private_names_read"]:
        print("   ", v)
    print(json.dumps({k: (len(v) if isinstance(v, list) else v) for k, v in r.items()}))


if __name__ == "__main__":
    main()
