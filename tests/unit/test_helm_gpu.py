"""deploy/helm/pdserve with `kvConnector: nixl` and GPU workers: rendered with real helm, every object validated
against the Kubernetes schemas, and what the router and workers get checked (the router speaks NixlConnector's
hand-off; workers load NixlConnector with their side channel on the pod's address; nvidia.com/gpu requested).
Skips like tests/unit/test_helm_chart.py when helm or kubernetes-validate is missing."""

from __future__ import annotations

import json
from functools import cache

import pytest
import yaml

from tests.unit.test_helm_chart import (
    CRD_KINDS,
    FULL,
    K8S_VERSIONS,
    container,
    helm_template,
    kubernetes_validate,
    objs,
)

NIXL_SETS = ("kvConnector=nixl", "prefill.gpus=1", "decode.gpus=1", "efa.enabled=true", "transfer.backend=nixl",
             "prefill.tensorParallelSize=2", "decode.tensorParallelSize=2")  # 1 GPU per rank x 2 ranks


@cache
def rendered(sets: tuple[str, ...]) -> tuple[dict, ...]:
    out = helm_template(sets=sets)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def deployments(sets: tuple[str, ...]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered(sets) if o["kind"] == "Deployment"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_nixl_gpu_objects_are_valid(version):
    for o in rendered(NIXL_SETS):
        if (o["apiVersion"], o["kind"]) not in CRD_KINDS:
            kubernetes_validate.validate(o, version, strict=True)


def test_nixl_workers_router_and_gpus():
    deps = deployments(NIXL_SETS)
    router = container(deps[f"{FULL}-router"], "router")["args"]
    assert router[router.index("--kv-connector") + 1] == "nixl"
    for role in ("prefill", "decode"):
        c = container(deps[f"{FULL}-{role}"], "vllm")
        kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
        assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda",
                      "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": {"kv_lease_duration": 30}}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        names = [e["name"] for e in c["env"]]
        assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST")  # $(POD_IP) expands
        assert {"name": "nixl-side", "containerPort": 5600, "protocol": "TCP"} in c["ports"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 2 and c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert "--tensor-parallel-size" in c["args"]  # TP through tensorParallelSize, as with pdserve's connector


def test_default_chart_keeps_pdserve_connector():
    deps = objs("default", "Deployment")  # the chart tests' own cached render
    assert "--kv-connector" not in container(deps[f"{FULL}-router"], "router")["args"]
    c = container(deps[f"{FULL}-decode"], "vllm")
    kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "PdserveConnector"
    assert not any(e["name"].startswith("VLLM_NIXL") for e in c["env"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    cpu = container(deployments(("prefill.gpus=0",))[f"{FULL}-prefill"], "vllm")
    assert "nvidia.com/gpu" not in json.dumps(cpu["resources"])


def test_nixl_extra_config_and_cpu_buffer():
    sets = ("kvConnector=nixl", "prefill.gpus=0", "decode.gpus=0", "nixl.extraConfig.backends={UCX}")
    c = container(deployments(sets)[f"{FULL}-prefill"], "vllm")
    kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_buffer_device"] == "cpu" and kv["kv_connector_extra_config"] == {"backends": ["UCX"],
                                                                                   "kv_lease_duration": 30}


def _progress(sets: tuple[str, ...], role: str) -> str | None:
    env = {e["name"]: e.get("value") for e in container(deployments(sets)[f"{FULL}-{role}"], "vllm")["env"]}
    return env.get("PDSERVE_NIXL_PROGRESS")


def test_nixl_progress_thread_idles_on_cpu_pods_only():
    """NIXL's UCX progress thread spins a core per worker (docs/architecture.md, "NIXL's progress thread"): CPU pods
    get PDSERVE_NIXL_PROGRESS=idle as the launcher's CPU workers do, GPU pods keep NIXL's own; nixl.progress
    overrides; pdserve's connector gets nothing."""
    mixed = ("kvConnector=nixl", "prefill.gpus=0", "decode.gpus=1")
    assert (_progress(mixed, "prefill"), _progress(mixed, "decode")) == ("idle", None)
    assert _progress((*mixed, "nixl.progress=idle"), "decode") == "idle"
    assert _progress((*mixed, "nixl.progress=default"), "prefill") is None
    assert _progress(("prefill.gpus=0",), "prefill") is None  # pdserve's connector: no NIXL
    out = helm_template(sets=(*mixed, "nixl.progress=spin"))
    assert out.returncode != 0 and "progress" in out.stderr


def test_nixl_refusals():
    out = helm_template(sets=("kvConnector=nixl", "store.enabled=true"))
    assert out.returncode != 0 and "store.enabled with kvConnector=nixl" in out.stderr
    out = helm_template(sets=("kvConnector=lmcache",))
    assert out.returncode != 0 and "kvConnector" in out.stderr
    out = helm_template(sets=("prefill.extraArgs={--tensor-parallel-size,2}",))
    assert out.returncode != 0 and "set prefill.tensorParallelSize instead" in out.stderr
