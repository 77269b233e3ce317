"""deploy/helm/pdserve with `kvConnector: mooncake`: rendered with real helm, every object validated against the
Kubernetes schemas; CPU pods load vLLM's MooncakeConnector through pdserve.vllm.mooncake_cpu, GPU pods vLLM's class as
it is; every worker pod advertises its own address and runs its bootstrap server on mooncake.bootstrapPort, which
the router is told; impossible combinations are refused. Skips like tests/unit/test_helm_chart.py when helm or
kubernetes-validate is missing."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_helm_chart import CRD_KINDS, K8S_VERSIONS, container, helm_template, kubernetes_validate
from tests.unit.test_helm_gpu import deployments, rendered

CPU = ("kvConnector=mooncake", "prefill.gpus=0", "decode.gpus=0")
GPU = ("kvConnector=mooncake", "prefill.gpus=1", "decode.gpus=1", "mooncake.protocol=rdma",
       "mooncake.extraConfig.device_name=mlx5_0")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_mooncake_objects_are_valid(version):
    for sets in (CPU, GPU):
        for o in rendered(sets):
            if (o["apiVersion"], o["kind"]) not in CRD_KINDS:
                kubernetes_validate.validate(o, version, strict=True)


def _kv(c: dict) -> dict:
    return json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])


def test_mooncake_workers_and_router():
    deps = deployments(CPU)
    for name, dep in deps.items():
        if name.endswith(("-prefill", "-decode")):
            c = container(dep, "vllm")
            kv = _kv(c)
            assert kv["kv_connector"] == "MooncakeConnector" and kv["kv_buffer_device"] == "cpu"
            assert kv["kv_connector_module_path"] == "pdserve.vllm.mooncake_cpu"
            assert kv["kv_load_failure_policy"] == "recompute"
            assert kv["kv_connector_extra_config"] == {"mooncake_protocol": "tcp"}
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["VLLM_HOST_IP"] == "$(POD_IP)" and env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "8998"
            assert env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] == "30"
            assert {"name": "mc-bootstrap", "containerPort": 8998, "protocol": "TCP"} in c["ports"]
    router = next(d for n, d in deps.items() if n.endswith("-router"))
    args = container(router, "router")["args"]
    assert args[args.index("--kv-connector") + 1] == "mooncake"
    assert args[args.index("--mooncake-bootstrap-port") + 1] == "8998"


def test_mooncake_gpu_pods_load_vllms_class():
    for name, dep in deployments(GPU).items():
        if name.endswith(("-prefill", "-decode")):
            c = container(dep, "vllm")
            kv = _kv(c)
            assert "kv_connector_module_path" not in kv and kv["kv_buffer_device"] == "cuda"
            assert kv["kv_connector_extra_config"] == {"mooncake_protocol": "rdma", "device_name": "mlx5_0"}
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] == "30"  # transfer.leaseSeconds, rounded up


@pytest.mark.parametrize("sets, needle", [
    (("kvConnector=mooncake", "store.enabled=true"), "store.enabled with kvConnector=mooncake"),
    (("kvConnector=mooncake", "elastic.replicas=3", "router.replicas=1", "elastic.gpus=0"),
     "elastic.replicas > 0 with kvConnector=mooncake"),
    (("kvConnector=mooncake", "mooncake.protocol=carrier-pigeon"), "mooncake/protocol"),
    (("kvConnector=mooncake", "mooncake.bootstrapPort=0"), "mooncake/bootstrapPort"),
    (("kvConnector=mooncake", "mooncake.unknown=1"), "unknown"),
])
def test_mooncake_refusals(sets, needle):
    out = helm_template(sets=sets)
    assert out.returncode != 0 and needle in out.stderr, out.stderr
