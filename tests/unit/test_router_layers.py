"""The router's layers (docs/architecture.md, "Router modules by concept"): each of router/'s sub-packages and top
modules imports only the layers below it, so there is no import loop between them.

Built on the import-cycle test's graph (every import anywhere in a module counts: deferred, TYPE_CHECKING,
relative). A unit is a sub-package of router/ (``api``, ``workers``, ...) or one of its top modules (``config``,
``app``, ...); imports inside one unit are the import-cycle test's business.
"""

from __future__ import annotations

from pathlib import Path

from scripts.import_graph import components, import_graph

ROOT = Path(__file__).resolve().parents[2]

# bottom -> top; a unit may import its own layer's other units only where it is the shared base
LAYERS: list[set[str]] = [
    {"errors", "config", "metrics", "admission"},  # shared by every layer: error shapes, the config, the metrics
    {"api"},  # the OpenAI surface: request parsing and answer shapes; knows nothing of workers
    {"workers"},  # the HTTP client of one worker and its streams
    {"fleet"},  # the view of the workers: registry, health, placement, KV feeds
    {"tracing"},  # a request's OpenTelemetry spans: over the placement, under the run that makes them
    {"run"},  # the run of one request: attempts, P -> D, relay, answer
    {"endpoints"},  # every endpoint's handler, over the run
    {"app"},  # wiring and lifecycle
    {"__main__", "router"},  # the process's entry and the package's __init__
]
LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str | None:
    """``pdserve.router.api.protocol`` -> ``api``; ``pdserve.router.app`` -> ``app``; None outside router/."""
    parts = module.split(".")
    if parts[:2] != ["pdserve", "router"]:
        return None
    return parts[2] if len(parts) > 2 else "router"


def unit_graph(root: Path) -> dict[str, set[str]]:
    """Unit -> the other units of router/ it imports."""
    out: dict[str, set[str]] = {}
    for module, targets in import_graph(root, "pdserve").items():
        unit = unit_of(module)
        if unit is None:
            continue
        edges = out.setdefault(unit, set())
        edges.update(t for t in map(unit_of, targets) if t is not None and t != unit)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a unit at the same or a higher layer (the base's units may import each other)."""
    bad = []
    for unit, targets in sorted(graph.items()):
        for target in sorted(targets):
            if LEVEL[target] > LEVEL[unit] or (LEVEL[target] == LEVEL[unit] and LEVEL[unit] != 0):
                bad.append(f"{unit} (layer {LEVEL[unit]}) imports {target} (layer {LEVEL[target]})")
    return bad


def test_every_unit_has_a_layer() -> None:
    assert sorted(set(unit_graph(ROOT)) - set(LEVEL)) == []


def test_router_units_import_only_downwards() -> None:
    assert upward_imports(unit_graph(ROOT)) == []


def test_no_import_loop_between_router_units() -> None:
    assert components(unit_graph(ROOT)) == []


def test_the_checker_sees_an_upward_import() -> None:
    """Negative control: api importing run (the loop the Messages handlers made) is reported, and makes a loop."""
    probe = ROOT / "pdserve" / "router" / "api" / "_layers_probe.py"
    probe.write_text("def f():\n    from ..run import generation\n")
    try:
        graph = unit_graph(ROOT)
    finally:
        probe.unlink()
    assert "api (layer 1) imports run (layer 5)" in upward_imports(graph)
    assert any({"api", "run"} <= set(c) for c in components(graph))
