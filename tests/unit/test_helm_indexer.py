"""deploy/helm/pdserve's KV indexer pod (``indexer.enabled``, off by default): its Deployment, Service and snapshot
volume, the flags its own CLI takes, DNS names that are the pools' headless Services, the pool master and secret
with pdserve's pool, and every router and picker replica pointed at its Service. Rendered with the real helm
binary; every object validated against the Kubernetes schemas (kubernetes-validate, strict)."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.test_helm_chart import CHART, FULL, HELM, INSTALL_HINT, K8S_VERSIONS, NAMESPACE, RELEASE

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install kubernetes-validate==1.37.0")
pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm binary not found: {INSTALL_HINT}")

ON = ("indexer.enabled=true", "router.policy=conductor")
URL = f"http://{FULL}-indexer.{NAMESPACE}.svc:8100"


def _helm(*sets: str):
    import subprocess

    cmd = [HELM, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def render(*sets: str) -> list[dict]:
    out = _helm(*sets)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _container(dep: dict, name: str) -> dict:
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def test_off_by_default_and_refused_without_the_conductor():
    docs = render()
    assert f"{FULL}-indexer" not in by_kind(docs, "Deployment") and "--indexer" not in str(docs)
    out = _helm("indexer.enabled=true")
    assert out.returncode != 0 and "router.policy=conductor" in out.stderr


def test_indexer_pod_is_wired_to_the_workers_the_routers_and_the_pickers():
    from pdserve.indexer.__main__ import build_parser, config_from
    from pdserve.picker.__main__ import build_parser as picker_parser
    from pdserve.router.__main__ import build_parser as router_parser

    docs = render(*ON, "inferenceExtension.enabled=true", "store.enabled=true")
    dep = by_kind(docs, "Deployment")[f"{FULL}-indexer"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    c = _container(dep, "indexer")
    assert c["command"] == ["python3", "-m", "pdserve.indexer"]
    cfg, host, port = config_from(build_parser().parse_args(c["args"]))  # the indexer's own CLI takes them
    assert (host, port, cfg.kv_events_port) == ("0.0.0.0", 8100, 5557)
    assert cfg.pool_master == f"{FULL}-store-master.{NAMESPACE}.svc:7600"
    secret = [e for e in c["env"] if e["name"] == "PDSERVE_TRANSFER_SECRET"]
    assert secret[0]["valueFrom"]["secretKeyRef"]["key"] == "PDSERVE_TRANSFER_SECRET"
    # the pools it follows are the pools' headless Services, on the workers' HTTP port (their URL = their topic)
    svcs = by_kind(docs, "Service")
    assert [(t.role, t.port) for t in cfg.dns] == [("prefill", 8000), ("decode", 8000)]
    for t in cfg.dns:
        svc = svcs[t.host.split(".")[0]]
        assert t.host == f"{svc['metadata']['name']}.{NAMESPACE}.svc" and svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == t.role
    # the snapshot lives on the mounted volume
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["snapshot"]
    assert cfg.snapshot_path.startswith(mount + "/")
    vol = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}["snapshot"]
    assert "emptyDir" in vol
    # its Service selects it, on the port its probes and the routers use
    svc = svcs[f"{FULL}-indexer"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items() and svc["spec"]["ports"][0]["port"] == 8100
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # every router and picker replica seeds from it and shares its placements through it
    r = router_parser().parse_args(_container(by_kind(docs, "Deployment")[f"{FULL}-router"], "router")["args"])
    p = picker_parser().parse_args(_container(by_kind(docs, "Deployment")[f"{FULL}-picker"], "picker")["args"])
    assert r.indexer == p.indexer == URL
    # the release's pods (routers, pickers) may reach it
    pol = by_kind(docs, "NetworkPolicy")[f"{FULL}-indexer"]
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_persistent_snapshot_volume_and_elastic_pools():
    docs = render(*ON, "indexer.persistence.enabled=true", "indexer.persistence.size=5Gi",
                  "indexer.persistence.storageClass=gp3")
    pvc = by_kind(docs, "PersistentVolumeClaim")[f"{FULL}-indexer"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi" and pvc["spec"]["storageClassName"] == "gp3"
    dep = by_kind(docs, "Deployment")[f"{FULL}-indexer"]
    vol = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}["snapshot"]
    assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    mine = render(*ON, "indexer.persistence.enabled=true", "indexer.persistence.existingClaim=snap")
    assert not by_kind(mine, "PersistentVolumeClaim")
    dep = by_kind(mine, "Deployment")[f"{FULL}-indexer"]
    assert {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}["snapshot"] == {
        "name": "snapshot", "persistentVolumeClaim": {"claimName": "snap"}}
    from pdserve.indexer.__main__ import build_parser, config_from

    el = by_kind(render("indexer.enabled=true", "elastic.replicas=2"), "Deployment")[f"{FULL}-indexer"]
    cfg, _, _ = config_from(build_parser().parse_args(_container(el, "indexer")["args"]))
    assert [(t.role, t.host) for t in cfg.dns] == [("prefill", f"{FULL}-elastic.{NAMESPACE}.svc")]
    assert cfg.pool_master == ""  # no pool in this release
    bad = _helm(*ON, "indexer.persistence.size=lots")
    assert bad.returncode != 0 and "size" in bad.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_objects_are_valid(version):
    errors = []
    for o in render(*ON, "store.enabled=true", "indexer.persistence.enabled=true"):
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, "\n".join(errors)
