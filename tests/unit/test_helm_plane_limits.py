"""deploy/helm/pdserve refuses what ``pdserve serve`` refuses in pdserve/launch/plane_limits.py: a Mamba /
linear-attention model (model.stateLayers, auto: by model.name) on vLLM's NixlConnector or MooncakeConnector in half
precision, with the launcher's message; float32, pdserve's connector or a model without such layers render."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.launch.plan import make_plan
from tests.unit.test_helm_chart import HELM, INSTALL_HINT, helm_template

pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm binary not found: {INSTALL_HINT}")

QWEN3_NEXT = "Qwen/Qwen3-Next-80B-A3B-Instruct"


def _launcher_message(tmp_path: Path, plane: str) -> str:
    model = tmp_path / "Qwen3-Next-80B-A3B-Instruct"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"]}))
    with pytest.raises(ConfigError) as err:
        make_plan(LauncherConfig(model=str(model), kv_connector=plane, pool=False, dtype="bfloat16"), model)
    return str(err.value)


@pytest.mark.parametrize("plane", ["nixl", "mooncake"])
def test_a_state_model_in_half_precision_is_refused_with_the_launcher_s_message(tmp_path, plane):
    out = helm_template(sets=(f"kvConnector={plane}", "store.enabled=false", f"model.name={QWEN3_NEXT}",
                              "model.dtype=bfloat16"))
    assert out.returncode != 0
    launcher = _launcher_message(tmp_path, plane)
    # the same sentence from the model's name on: only how the layers were found differs (config.json vs name)
    tail = launcher[launcher.index("), and vLLM 0.32's"):]
    assert launcher.split(": the model has")[0] in out.stderr, out.stderr[-800:]
    assert tail in out.stderr, out.stderr[-800:]
    assert "model.stateLayers=false if it has none" in out.stderr


@pytest.mark.parametrize("sets", [
    ("kvConnector=nixl", f"model.name={QWEN3_NEXT}", "model.dtype=float32"),
    ("kvConnector=nixl", f"model.name={QWEN3_NEXT}", "model.stateLayers=false"),
    ("kvConnector=pdserve", f"model.name={QWEN3_NEXT}"),
    ("kvConnector=mooncake", "model.name=Qwen/Qwen2.5-7B-Instruct"),
])
def test_what_renders(sets):
    out = helm_template(sets=(*sets, "store.enabled=false"))
    assert out.returncode == 0, out.stderr[-800:]


def test_state_layers_named_in_values_are_refused_whatever_the_name():
    out = helm_template(sets=("kvConnector=mooncake", "store.enabled=false", "model.name=org/some-model",
                              "model.stateLayers=true", "model.dtype=bfloat16"))
    assert out.returncode != 0 and "(model.stateLayers=true)" in out.stderr and "in bfloat16" in out.stderr
