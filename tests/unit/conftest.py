"""Fixtures shared by the unit tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder the launcher's config accepts: a Llama ``config.json`` and nothing else (no weights). A test
    module that needs a real model defines its own ``model_dir``, which overrides this one."""
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return d
