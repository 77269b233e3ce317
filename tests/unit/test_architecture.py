"""The dependency rules of docs/architecture.md, checked on the source: each package imports only what it may.

Imports are read with ``ast`` (module level and inside functions alike), so a lazy import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "pdserve"

# package -> (pdserve packages/modules it may import, third-party top-level modules it must not import)
RULES: dict[str, tuple[set[str], set[str]]] = {
    # the transfer engine takes the shared secret's rule and the backends' names from the bottom layer
    "transfer": ({"settings"}, {"vllm", "aiohttp", "zmq", "transformers"}),
    # the table of settings is the bottom layer: it imports no other pdserve package
    "settings": (set(), {"vllm", "aiohttp", "torch", "zmq", "transformers"}),
    "conductor": ({"hashing", "settings"}, {"vllm", "aiohttp", "torch", "zmq", "transformers"}),
    "store": ({"settings", "transfer"}, {"vllm", "aiohttp", "transformers"}),
    "router": ({"conductor", "hashing", "http_probe", "indexer", "prom", "settings", "store", "transfer"},
               {"vllm", "torch"}),
    # the KV indexer service: the conductor's index and translators, the router's KV event feed and pool follower
    # (they stay in router/fleet/ while that package is restructured), the pool's RPC client through them
    # and kube's DNS discovery rules (--prefill-dns / --decode-dns: the chart's indexer pod)
    "indexer": ({"conductor", "hashing", "kube", "router", "settings", "store", "transfer"}, {"vllm", "torch"}),
    # the endpoint picker: the router's placement without its HTTP front; kube's DNS discovery rules
    # (--prefill-dns / --decode-dns) applied to its own registry
    "picker": ({"conductor", "hashing", "indexer", "kube", "router", "settings"}, {"vllm", "torch", "aiohttp.web"}),
    # plan/measure.py times the transfer engine to calibrate the planner's network model
    "plan": ({"conductor", "hashing", "bench", "prom", "transfer", "dtype", "settings"}, {"vllm"}),
    "bench": ({"launch", "prom", "hashing", "settings"}, {"vllm", "torch"}),
}
# The one exception to "the router never imports vLLM": vLLM's own tool-call parsers (issue 15), imported inside
# functions only, on the first tool request (docs/architecture.md section 7).
LAZY_VLLM = {"pdserve/router/api/tools.py"}


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _imports(path: Path) -> set[str]:
    """Dotted names this file imports, relative imports resolved against its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = path.relative_to(ROOT).with_suffix("").parts
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                mod = ".".join(base + ((node.module,) if node.module else ()))
                if node.module:
                    names.add(mod)
                else:  # `from .. import x`: x may itself be a module
                    names.update(f"{mod}.{a.name}" for a in node.names)
            elif node.module:
                names.add(node.module)
    return names


def _violations(package: str, files: list[Path] | None = None) -> list[str]:
    allowed, banned = RULES[package]
    bad: list[str] = []
    for path in files if files is not None else sorted((PKG / package).rglob("*.py")):
        for name in _imports(path):
            top, _, rest = name.partition(".")
            where = path.relative_to(ROOT)
            if top == "vllm" and str(where) in LAZY_VLLM:
                continue  # checked by test_lazy_vllm_imports_stay_lazy
            if top in banned:
                bad.append(f"{where}: imports {name}")
            elif top == "pdserve" and rest:
                sub = rest.split(".")[0]
                if sub != package and sub not in allowed:
                    bad.append(f"{where}: imports {name} (pdserve.{package} may import only {sorted(allowed)})")
    return bad


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_follow_the_rules(package: str) -> None:
    assert _violations(package) == []


# The config layer (launch/config*.py: the launcher's configs beside the table of settings) sits under the rest of
# launch/ and under vllm/ and router/: it imports none of them, so each may import it without a circle.
CONFIG_MODULES = sorted((PKG / "launch").glob("config*.py"))
CONFIG_MAY_NOT = {"vllm", "router", "cli", "bench", "plan"}


def _above_config(name: str) -> bool:
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "pdserve":
        return False
    if parts[1] == "launch":  # the launcher's own modules, other than the config layer's
        return len(parts) < 3 or not parts[2].startswith("config")
    return parts[1] in CONFIG_MAY_NOT


def test_config_layer_imports_nothing_above_it() -> None:
    assert len(CONFIG_MODULES) >= 3
    bad = [f"{p.relative_to(ROOT)}: imports {n}" for p in CONFIG_MODULES for n in sorted(_imports(p))
           if _above_config(n)]
    assert bad == []


def test_only_the_vllm_package_imports_vllm() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted(PKG.rglob("*.py"))
        if p.parent.name != "vllm" and str(p.relative_to(ROOT)) not in LAZY_VLLM
        and any(n == "vllm" or n.startswith("vllm.") for n in _imports(p))
    ]
    assert offenders == []


def test_lazy_vllm_imports_stay_lazy() -> None:
    for name in LAZY_VLLM:
        top = {n.partition(".")[0] for n in _module_level_imports(ROOT / name)}
        assert not top & {"vllm", "torch"}, f"{name} imports vLLM or torch at module level"


def test_the_checker_sees_banned_imports() -> None:
    """Negative control: a relative, a lazy and a third-party import that break the rules are all reported."""
    probe = PKG / "conductor" / "_architecture_probe.py"
    probe.write_text("from ..router import app\n\ndef f():\n    import aiohttp\n    from pdserve.vllm import params\n")
    try:
        bad = _violations("conductor", [probe])
    finally:
        probe.unlink()
    assert [b.split(": imports ")[1].split(" ")[0] for b in sorted(bad)] == [
        "aiohttp", "pdserve.router", "pdserve.vllm"]
