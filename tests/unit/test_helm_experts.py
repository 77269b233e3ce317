"""deploy/helm/pdserve with MoE pools: a wide-EP decode pool (decode.dataParallelSize, decode.expertParallel) gets
vLLM's --data-parallel-size and --enable-expert-parallel, GPUs and a transfer port for every TP x DP rank (container
ports and the NetworkPolicy), and the refusals (DP on CPU pods, with the KV pool, with the conductor, via extraArgs)."""

from __future__ import annotations

import pytest

from tests.unit.test_helm_chart import HELM, INSTALL_HINT, helm_template
from tests.unit.test_helm_tp import _render, _vllm

pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm binary not found: {INSTALL_HINT}")


def test_wide_ep_decode_pool_gets_its_ranks_gpus_and_transfer_ports():
    docs = _render("decode.dataParallelSize=4", "decode.expertParallel=true", "decode.gpus=1",
                   "prefill.tensorParallelSize=2", "prefill.expertParallel=true", "transfer.backend=tcp",
                   "store.enabled=false", "networkPolicy.enabled=true", "router.policy=least_loaded")
    p, d = _vllm(docs, "prefill"), _vllm(docs, "decode")
    assert d["args"][d["args"].index("--data-parallel-size") + 1] == "4" and "--enable-expert-parallel" in d["args"]
    assert "--tensor-parallel-size" not in d["args"] and "--data-parallel-size" not in p["args"]
    assert "--enable-expert-parallel" in p["args"]
    assert d["resources"]["limits"]["nvidia.com/gpu"] == 4
    ports = {x["name"]: x["containerPort"] for x in d["ports"]}
    assert ports["kv-transfer-3"] == ports["kv-transfer"] + 3
    policies = [x for x in docs if x["kind"] == "NetworkPolicy"]
    ranges = [(q.get("port"), q.get("endPort")) for pol in policies for rule in pol["spec"].get("ingress", [])
              for q in rule.get("ports") or [] if q.get("endPort")]
    assert (ports["kv-transfer"], ports["kv-transfer"] + 3) in ranges


@pytest.mark.parametrize("sets, words", [
    (("decode.dataParallelSize=2", "decode.gpus=0", "store.enabled=false", "router.policy=least_loaded"),
     "on CPU pods"),
    (("decode.dataParallelSize=2", "decode.gpus=1", "store.enabled=true", "router.policy=least_loaded"),
     "with store.enabled"),
    (("decode.dataParallelSize=2", "decode.gpus=1", "store.enabled=false", "router.policy=conductor"),
     "with the conductor"),
    (("decode.extraArgs={--data-parallel-size,2}", "store.enabled=false"), "set decode.dataParallelSize instead"),
    (("decode.expertParallel=true", "decode.gpus=0", "decode.tensorParallelSize=2", "store.enabled=false"),
     "decode.expertParallel on CPU pods"),
])
def test_refused(sets, words):
    out = helm_template(sets=sets)
    assert out.returncode != 0 and words in out.stderr, out.stderr[-600:]
