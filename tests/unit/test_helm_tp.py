"""deploy/helm/pdserve with tensor-parallel pools: vLLM's --tensor-parallel-size, GPUs per rank, a transfer port
per rank (container ports and the NetworkPolicy), and the refusals (TP through extraArgs, TP with the KV pool)."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.test_helm_chart import FULL, HELM, INSTALL_HINT, helm_template

pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm binary not found: {INSTALL_HINT}")


def _render(*sets: str) -> list[dict]:
    out = helm_template(sets=sets)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _vllm(docs: list[dict], role: str) -> dict:
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{FULL}-{role}")
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")


def test_tp_pool_gets_its_ranks_gpus_and_transfer_ports():
    docs = _render("prefill.tensorParallelSize=2", "prefill.gpus=1", "decode.tensorParallelSize=1",
                   "transfer.backend=tcp", "networkPolicy.enabled=true")
    p, d = _vllm(docs, "prefill"), _vllm(docs, "decode")
    i = p["args"].index("--tensor-parallel-size")
    assert p["args"][i + 1] == "2" and "--tensor-parallel-size" not in d["args"]
    assert p["resources"]["limits"]["nvidia.com/gpu"] == 2 and d["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = next(x["containerPort"] for x in p["ports"] if x["name"] == "kv-transfer")
    assert {x["name"]: x["containerPort"] for x in p["ports"]}["kv-transfer-1"] == port + 1
    assert "kv-transfer-1" not in {x["name"] for x in d["ports"]}
    policies = [x for x in docs if x["kind"] == "NetworkPolicy"]
    ranges = [(q.get("port"), q.get("endPort")) for pol in policies for rule in pol["spec"].get("ingress", [])
              for q in rule.get("ports") or [] if q.get("endPort")]
    assert (port, port + 1) in ranges


@pytest.mark.parametrize("sets, needle", [
    (("decode.extraArgs={--tensor-parallel-size,2}",), "set decode.tensorParallelSize instead"),
    (("prefill.tensorParallelSize=2", "store.enabled=true"), "supports tensorParallelSize 1 only"),
    (("decode.tensorParallelSize=0",), "tensorParallelSize"),
])
def test_tp_refusals_are_actionable(sets, needle):
    out = helm_template(sets=sets)
    assert out.returncode != 0 and needle in out.stderr, out.stderr
