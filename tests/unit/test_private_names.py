"""No module in pdserve/ reads another module's underscored names (docs/architecture.md section 5; the checker: scripts/private_names.py).

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

from pathlib import Path

from scripts.private_names import violations

ROOT = Path(__file__).resolve().parents[2]


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
