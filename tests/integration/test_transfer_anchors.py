"""The Mooncake TE and NIXL adapters, between real processes; skipped where the package is absent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, SECRET

pytestmark = [pytest.mark.integration, pytest.mark.anchor]
MODULES = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}


def importable(backend: str) -> bool:
    code = f"import os, {MODULES[backend]}; os._exit(0)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("backend", sorted(MODULES))
def test_adapter_moves_bytes_exactly_and_notifies(spawn_peer, backend):
    if importlib.util.find_spec(MODULES[backend].split(".")[0]) is None or not importable(backend):
        pytest.skip(f"{backend} is not installed")
    size = 8 << 20
    peer = spawn_peer(size, seed=3, backend=backend)
    assert backend in peer.descriptor["backends"]
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("anchor_initiator.py")), backend,
         json.dumps(peer.descriptor), SECRET],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stderr[-2000:]
    result = json.loads(lines[-1])
    assert result == {"read_back_equal": True, "backend_used": backend}
    assert peer.notes() == ["anchor-1"]
