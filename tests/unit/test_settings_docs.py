"""The docs' option tables are generated from the table of settings; the committed ones must equal it
(regenerate with ``python -m pdserve.settings.docs docs/options.md README.md``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.settings import of
from pdserve.settings.docs import markdown, refresh, regions

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "options.md"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_committed_option_tables_equal_the_generated_ones(path):
    text = path.read_text()
    assert regions(text) >= 1
    assert refresh(text) == text, f"{path.name}: run python -m pdserve.settings.docs {path.relative_to(ROOT)}"


def test_every_flag_is_in_the_options_doc():
    text = (ROOT / "docs" / "options.md").read_text()
    for process in ("launcher", "router"):
        for s in of(process):
            assert f"`{s.off_flag or s.cli_flag}`" in text or f"`{s.name}`" in text, s.name


def test_a_stale_table_is_seen():
    fresh = "<!-- settings: router failures short -->\n" + markdown("router", "failures", short=True) + \
        "<!-- /settings -->\n"
    assert refresh(fresh) == fresh
    stale = fresh.replace("`2`", "`3`", 1)
    assert refresh(stale) == fresh != stale
