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
POOL = ("store.enabled=true", "store.backend=mooncake")
GPU = ("kvConnector=mooncake", "prefill.gpus=1", "decode.gpus=1", "mooncake.protocol=rdma",
       "mooncake.extraConfig.device_name=mlx5_0")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_mooncake_objects_are_valid(version):
    for sets in (CPU, GPU, CPU + POOL, ("kvConnector=nixl", *POOL)):
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


@pytest.mark.parametrize("connector", ["mooncake", "nixl"])
def test_mooncake_store_pool(connector):
    sets = (f"kvConnector={connector}", "prefill.gpus=1", "decode.gpus=1", *POOL, "store.mooncake.segmentGiB=2")
    objs = rendered(sets)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("Deployment", "pd-pdserve-store-master") in kinds and ("Service", "pd-pdserve-store-master") in kinds
    assert not any(n.endswith("store-node") for _, n in kinds)  # pdserve's store nodes are not run
    master = container(deployments(sets)["pd-pdserve-store-master"], "master")
    assert master["command"] == ["mooncake_master"] and master["args"][master["args"].index("--rpc_port") + 1] == "7600"
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("mooncake-store"))
    store = json.loads(cm["data"]["mooncake-store.json"])
    assert store["master_server_address"].startswith("pd-pdserve-store-master.") and store["master_server_address"].endswith(":7600")
    assert store["global_segment_size"] == "2048MB" and store["metadata_server"] == "P2PHANDSHAKE"
    for name, dep in deployments(sets).items():
        if name.endswith(("-prefill", "-decode")):
            c = container(dep, "vllm")
            kv = _kv(c)
            assert kv["kv_connector"] == "MultiConnector"
            first, second = kv["kv_connector_extra_config"]["connectors"]
            assert second["kv_connector"] == "MooncakeStoreConnector"
            if connector == "mooncake":  # GPU pods too: the subclass with the counters MultiConnector needs
                assert first["kv_connector_module_path"] == "pdserve.vllm.mooncake_cpu"
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["MOONCAKE_CONFIG_PATH"] == "/etc/pdserve/mooncake/mooncake-store.json"
            assert {"name": "mooncake-store", "mountPath": "/etc/pdserve/mooncake", "readOnly": True} in c[
                "volumeMounts"]
    router = container(deployments((*sets, "router.policy=conductor"))["pd-pdserve-router"], "router")["args"]
    # the conductor follows the store: the master's HTTP metrics server (router --mooncake-store)
    store_http = router[router.index("--mooncake-store") + 1]
    metrics_port = master["args"][master["args"].index("--metrics_port") + 1]
    assert store_http.startswith("pd-pdserve-store-master.") and store_http.endswith(f":{metrics_port}")
    router = container(deployments(sets)["pd-pdserve-router"], "router")["args"]
    assert "--mooncake-store" not in router  # only the conductor reads it (the default policy is round_robin)


@pytest.mark.parametrize("sets, needle", [
    (POOL, "store.backend=mooncake with kvConnector=pdserve"),
    (("kvConnector=nixl", "store.enabled=true"), "use store.backend=mooncake"),
    ((*CPU, *POOL, "store.backend=lmcache"), "store/backend"),
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
