"""deploy/helm/pdserve's Gateway API Inference Extension objects (``inferenceExtension.enabled``, off by default):
an InferencePool of the decode pods, the endpoint picker's Deployment and Service, the gateway's NetworkPolicy.
Rendered with the real helm binary; the Kubernetes objects validated against the Kubernetes schemas
(kubernetes-validate, strict) and the InferencePool against the extension's released CRD (its openAPIV3Schema,
with the CRD's CEL rules checked by hand) when ``PDSERVE_INFERENCEPOOL_CRD`` names the CRD file
(``inference.networking.k8s.io_inferencepools.yaml`` of a release, or the release's ``manifests.yaml``): no PyPI,
npm or Debian package carries it, and the repository does not copy it. The wiring (pool -> decode pods and port,
picker reference -> Service -> container, the picker's flags) is checked either way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.unit.test_helm_chart import CHART, FULL, HELM, INSTALL_HINT, K8S_VERSIONS, NAMESPACE, RELEASE

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install kubernetes-validate==1.37.0")
pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm binary not found: {INSTALL_HINT}")

ON = ("inferenceExtension.enabled=true", "router.policy=conductor")
CRD_ENV = "PDSERVE_INFERENCEPOOL_CRD"


def render(*sets: str) -> list[dict]:
    import subprocess

    cmd = [HELM, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def refused(*sets: str) -> str:
    import subprocess

    cmd = [HELM, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, "helm rendered what it should refuse"
    return out.stderr


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_off_by_default_and_refused_without_the_conductor():
    docs = render()
    assert not by_kind(docs, "InferencePool") and f"{FULL}-picker" not in by_kind(docs, "Deployment")
    assert "router.policy=conductor" in refused("inferenceExtension.enabled=true")
    assert "prefill + decode" in refused(*ON, "elastic.replicas=2")


def test_pool_picker_and_service_are_wired_together():
    from pdserve.picker.__main__ import build_parser

    docs = render(*ON)
    pool = by_kind(docs, "InferencePool")[FULL]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    decode = by_kind(docs, "Deployment")[f"{FULL}-decode"]
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = [p["containerPort"] for c in decode["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8200] and 8200 in ports  # the routing sidecar
    ref = pool["spec"]["endpointPickerRef"]
    svc = by_kind(docs, "Service")[ref["name"]]
    assert ref["kind"] == "Service" and svc["spec"]["ports"][0]["port"] == ref["port"]["number"] == 9002
    picker = by_kind(docs, "Deployment")[ref["name"]]
    assert svc["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    (c,) = picker["spec"]["template"]["spec"]["containers"]
    assert {p["name"] for p in c["ports"]} == {svc["spec"]["ports"][0]["targetPort"]}
    assert c["command"] == ["python3", "-m", "pdserve.picker"]
    a = build_parser().parse_args(c["args"])  # the picker's own CLI takes the chart's flags
    assert a.picker_port == 9002 and a.picker_host == "0.0.0.0" and a.policy == "conductor"
    assert a.destination_port == 8200  # the decode pods' routing sidecar, the pool's target port
    assert a.prefill == [] and a.decode == [] and a.kv_events_port == 5557
    assert a.prefill_dns == f"{FULL}-prefill.{NAMESPACE}.svc:8000"
    assert a.decode_dns == f"{FULL}-decode.{NAMESPACE}.svc:8000"
    assert a.routers == 4  # 2 pickers + 2 routers place on the same workers
    # the pools' headless Services are what the picker resolves
    svcs = by_kind(docs, "Service")
    for name in (a.prefill_dns, a.decode_dns):
        assert svcs[name.split(".")[0]]["spec"]["clusterIP"] == "None"
    gw = by_kind(docs, "NetworkPolicy")[f"{FULL}-inference-gateway"]
    assert {p["port"] for p in gw["spec"]["ingress"][0]["ports"]} == {9002, 8200}


def test_decode_pods_get_the_routing_sidecar():
    """The decode pods (only they) run pdserve's router --prefiller-header beside vLLM, on the pool's target port,
    with the pod's vLLM as its one --decode; a discovery container adds the prefill pool to it through its
    membership API. The router's and discovery's own CLIs take the chart's flags."""
    from pdserve.kube.discovery import build_parser as discovery_parser
    from pdserve.router.__main__ import build_parser

    docs = render(*ON)
    deps = by_kind(docs, "Deployment")
    pod = deps[f"{FULL}-decode"]["spec"]["template"]["spec"]
    cs = {c["name"]: c for c in pod["containers"]}
    assert set(cs) == {"vllm", "decode-sidecar", "sidecar-discovery"}
    side = cs["decode-sidecar"]
    assert side["command"] == ["python3", "-m", "pdserve.router"]
    a = build_parser().parse_args(side["args"])
    assert a.prefiller_header and a.port == 8200 and a.host == "0.0.0.0"
    assert a.decode == ["http://127.0.0.1:8000"] and not a.prefill
    assert {p["name"]: p["containerPort"] for p in side["ports"]} == {"sidecar": 8200}
    d = discovery_parser().parse_args(cs["sidecar-discovery"]["args"])
    assert d.router == "http://127.0.0.1:8200" and d.prefill_dns == f"{FULL}-prefill.{NAMESPACE}.svc:8000"
    assert not d.decode_dns
    assert [c["name"] for c in deps[f"{FULL}-prefill"]["spec"]["template"]["spec"]["containers"]] == ["vllm"]
    nixl = by_kind(render(*ON, "kvConnector=nixl", "lora.enabled=true"), "Deployment")[f"{FULL}-decode"]
    side = {c["name"]: c for c in nixl["spec"]["template"]["spec"]["containers"]}["decode-sidecar"]
    a = build_parser().parse_args(side["args"])  # the data plane and LoRA as the router's
    assert a.kv_connector == "nixl" and a.enable_lora
    off = by_kind(render(), "Deployment")[f"{FULL}-decode"]["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in off] == ["vllm"]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-tokenizer"]  # the sidecar's tokenizer (source hf)
    assert a.model_dir == "/models/router-tokenizer"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_kubernetes_objects_are_valid(version):
    errors = []
    for o in render(*ON):
        if o["kind"] == "InferencePool":
            continue
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, "\n".join(errors)


def _crd() -> dict:
    path = os.environ.get(CRD_ENV, "")
    if not path:
        pytest.skip(f"{CRD_ENV} is not set: point it at the released InferencePool CRD "
                    "(config/crd/bases/inference.networking.k8s.io_inferencepools.yaml of a gateway-api-inference-"
                    "extension release, or its manifests.yaml)")
    for doc in yaml.safe_load_all(Path(path).read_text()):
        if doc and doc.get("kind") == "CustomResourceDefinition" and \
                doc["metadata"]["name"] == "inferencepools.inference.networking.k8s.io":
            return doc
    raise AssertionError(f"{path} has no inferencepools.inference.networking.k8s.io CRD")


def _json_schema(openapi: dict) -> dict:
    """An OpenAPI v3 structural schema as JSON Schema: the x-kubernetes-* keys dropped (the CEL rules are
    checked in :func:`_cel_rules`), everything else is JSON Schema already."""
    if isinstance(openapi, dict):
        return {k: _json_schema(v) for k, v in openapi.items() if not k.startswith("x-kubernetes-")}
    if isinstance(openapi, list):
        return [_json_schema(v) for v in openapi]
    return openapi


def _cel_rules(spec: dict) -> list[str]:
    """The CRD's two CEL rules, as Python (the test fails on a rule it does not know, below)."""
    broken = []
    ref = spec.get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
        broken.append("port is required when kind is 'Service'")
    numbers = [p["number"] for p in spec["targetPorts"]]
    if len(numbers) != len(set(numbers)):
        broken.append("port number must be unique")
    return broken


def _rules(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [r["rule"] for r in node.get("x-kubernetes-validations", [])]
        return found + [r for v in node.values() for r in _rules(v)]
    if isinstance(node, list):
        return [r for v in node for r in _rules(v)]
    return []


KNOWN_RULES = {"self.kind != 'Service' || has(self.port)", "self.all(p1, self.exists_one(p2, p1.number==p2.number))"}


def test_the_inference_pool_is_valid_against_the_released_crd():
    import jsonschema

    crd = _crd()
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    assert "v1" in served, f"the CRD serves {sorted(served)}, not v1"
    openapi = served["v1"]["schema"]["openAPIV3Schema"]
    assert set(_rules(openapi)) <= KNOWN_RULES, f"the CRD has CEL rules this test does not check: {_rules(openapi)}"
    validator = jsonschema.Draft7Validator(_json_schema(openapi))
    for sets in (ON, (*ON, "inferenceExtension.failureMode=FailOpen", "inferenceExtension.poolName=llama",
                      "decode.port=8200", "inferenceExtension.picker.port=9100")):
        (pool,) = by_kind(render(*sets), "InferencePool").values()
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(pool)]
        assert not errors and not _cel_rules(pool["spec"]), errors or _cel_rules(pool["spec"])
    # the check can fail: the same schema refuses a broken pool
    bad = {**pool, "spec": {**pool["spec"], "targetPorts": [], "selector": {}}}
    assert len(list(validator.iter_errors(bad))) == 2
