"""deploy/helm/pdserve in elastic mode (``elastic.replicas: N``): one pool of N kv_both workers with no fixed role
instead of the prefill and decode pools, the router started with the conductor in elastic mode (discovery
following the elastic pool, or the pool's Service as its one --elastic member), and the values that cannot work
refused with a message. Rendered with real helm; skips like tests/unit/test_helm_chart.py."""

from __future__ import annotations

import json
from functools import cache

import pytest
import yaml

from tests.unit.test_helm_chart import (
    CRD_KINDS,
    FULL,
    HELM,
    INSTALL_HINT,
    K8S_VERSIONS,
    NAMESPACE,
    container,
    helm_template,
    kubernetes_validate,
)

pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm binary not found: {INSTALL_HINT}")

ELASTIC = ("elastic.replicas=3", "router.replicas=1", "elastic.gpus=0")  # three CPU workers, one router
POOL_HOST = f"{FULL}-elastic.{NAMESPACE}.svc"


@cache
def rendered(sets: tuple[str, ...]) -> tuple[dict, ...]:
    out = helm_template(sets=sets)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def of_kind(sets: tuple[str, ...], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered(sets) if o["kind"] == kind}


def router_args(sets: tuple[str, ...]):
    from pdserve.router.__main__ import build_parser

    return build_parser().parse_args(container(of_kind(sets, "Deployment")[f"{FULL}-router"], "router")["args"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_elastic_objects_are_valid(version):
    for o in rendered(ELASTIC):
        if (o["apiVersion"], o["kind"]) not in CRD_KINDS:
            kubernetes_validate.validate(o, version, strict=True)


def test_one_elastic_pool_of_kv_both_workers_replaces_prefill_and_decode():
    from pdserve.vllm.params import ConnectorConfig

    deps = of_kind(ELASTIC, "Deployment")
    assert sorted(deps) == [f"{FULL}-elastic", f"{FULL}-router"]
    dep = deps[f"{FULL}-elastic"]
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "elastic"
    vllm = container(dep, "vllm")
    ktc = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    assert (ktc["kv_connector"], ktc["kv_role"]) == ("PdserveConnector", "kv_both")
    extra = dict(ktc["kv_connector_extra_config"], advertise_host="10.1.2.3")
    assert ConnectorConfig.from_extra(extra, env={"PDSERVE_TRANSFER_SECRET": "s" * 48}).transfer_port == 14579
    # the router's conductor learns the workers' prefix caches from their KV events
    assert "--kv-events-config" in vllm["args"]
    assert {e["name"]: e.get("value") for e in vllm["env"]}["PDSERVE_ROLE"] == "elastic"
    assert "nvidia.com/gpu" not in vllm["resources"]["requests"]
    svcs = of_kind(ELASTIC, "Service")
    assert svcs[f"{FULL}-elastic"]["spec"]["clusterIP"] == "None"
    assert f"{FULL}-prefill" not in svcs and f"{FULL}-decode" not in svcs
    assert sorted(of_kind(ELASTIC, "PodDisruptionBudget")) == [f"{FULL}-elastic"]  # one router: no router PDB


def test_router_runs_the_conductor_in_elastic_mode_and_discovery_follows_the_pool():
    from pdserve.kube.discovery import PoolTarget, config_from_args

    a = router_args(ELASTIC)
    assert (a.policy, a.mode_hint, a.elastic, a.prefill, a.decode) == ("conductor", "elastic", [], [], [])
    assert a.max_num_batched_tokens == 2048  # vLLM's CPU default: the conductor's chunk model
    assert a.kv_events_port == 5557 and a.kv_events_bind == ""
    disc = container(of_kind(ELASTIC, "Deployment")[f"{FULL}-router"], "discovery")
    cfg, _ = config_from_args(disc["args"])
    assert cfg.pools == (PoolTarget("elastic", POOL_HOST, 8000),)
    assert cfg.tombstone_s == 300 + 35 + 30  # the elastic pool's whole drain


def test_without_discovery_the_pool_service_is_the_one_elastic_member_and_the_step_budget_follows_the_model():
    sets = (*ELASTIC, "router.discovery.enabled=false", "model.maxNumBatchedTokens=512")
    a = router_args(sets)
    assert (a.mode_hint, a.elastic, a.max_num_batched_tokens) == ("", [f"http://{POOL_HOST}:8000"], 512)
    vllm = container(of_kind(sets, "Deployment")[f"{FULL}-elastic"], "vllm")
    assert vllm["args"][vllm["args"].index("--max-num-batched-tokens") + 1] == "512"
    # GPU pods: vLLM's default depends on the device, so the router is not told one
    assert router_args(("elastic.replicas=2", "router.replicas=1")).max_num_batched_tokens is None


def test_elastic_roles_with_several_routers():
    a = router_args(("elastic.replicas=2", "router.replicas=2", "elastic.gpus=0"))
    assert (a.policy, a.routers, a.kv_events_port) == ("conductor", 2, 5557)  # each replica subscribes


def test_elastic_values_that_cannot_work_fail_with_actionable_messages():
    cases = {(*ELASTIC, "kvConnector=nixl"): "elastic roles split requests through pdserve's connector; use "
                                             "kvConnector=pdserve",
             (*ELASTIC, "elastic.kvRole=kv_producer"): "elastic.kvRole=\"kv_producer\": elastic workers prefill "
                                                       "and decode, per request; use kv_both",
             (*ELASTIC, "autoscaling.enabled=true"): "scale the elastic pool with elastic.replicas"}
    for sets, msg in cases.items():
        out = helm_template(sets=sets)
        assert out.returncode != 0 and msg in out.stderr, (sets, out.stderr[-400:])
