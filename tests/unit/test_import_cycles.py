"""No import circles in pdserve/, checked on the source with ``ast``: what counts as an edge and how a circle
is reported are in scripts/import_graph.py's docstring."""

from __future__ import annotations

from pathlib import Path

from scripts.import_graph import cycles

ROOT = Path(__file__).resolve().parents[2]


def test_pdserve_has_no_import_cycles() -> None:
    found = cycles(ROOT, "pdserve")
    assert not found, "import circles in pdserve/:\n" + "\n".join(found)


def test_the_checker_finds_cycles_however_they_are_imported(tmp_path: Path) -> None:
    """Negative control: circles through a deferred import, a TYPE_CHECKING import, a relative ``from . import``
    of a submodule and a package ``__init__`` are each found, as paths; an acyclic package passes."""
    pkg = tmp_path / "probe"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from . import b\n",  # a -> b, deferred
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",  # b -> c
        "c.py": "import probe.a\n",  # c -> a: circle a -> b -> c -> a
        "d.py": "from .sub import e\n",  # d -> sub.e (a submodule, not the package)
        "sub/__init__.py": "from .. import d\n",  # sub -> d
        "sub/e.py": "from probe.sub import VALUE\n",  # e -> sub: circle d -> sub.e -> sub -> d
        "leaf.py": "import os\nfrom . import a\n",  # into a circle, not on one
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert cycles(tmp_path, "probe") == ["probe.a -> probe.b -> probe.c -> probe.a",
                                         "probe.d -> probe.sub.e -> probe.sub -> probe.d"]
    (pkg / "c.py").write_text("import os\n")
    (pkg / "sub" / "__init__.py").write_text("")
    assert cycles(tmp_path, "probe") == []
