"""deploy/helm/pdserve's Grafana dashboard (a ConfigMap) and PrometheusRule alerts (issue 40): off by default; on,
valid objects whose every query names a metric the router really exports (read from a real router's registry) or
kube-state-metrics' restart counter, with the thresholds from the values; bad thresholds refused by the schema.
Skips like tests/unit/test_helm_chart.py when helm or kubernetes-validate is missing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
from pdserve.router.fleet.placement import ConductorPlacement
from pdserve.router.fleet.prediction_error import PredictionErrors
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.metrics import ConductorCollector, RouterMetrics
from tests.unit.test_helm_chart import K8S_VERSIONS, helm_template, kubernetes_validate
from tests.unit.test_helm_gpu import rendered

ON = ("metrics.grafanaDashboard.enabled=true", "metrics.prometheusRule.enabled=true")
KUBE_STATE = {"kube_pod_container_status_restarts_total"}


def exported() -> set[str]:
    """Every sample name a router's /metrics can hold: its instruments, the conductor's and the prediction error."""
    metrics = RouterMetrics()
    placement = ConductorPlacement(Conductor(ConductorConfig(), OnlineCostModel(1000)),
                                   WorkerRegistry((("prefill", "http://p"), ("decode", "http://d"))))
    metrics.registry.register(ConductorCollector(placement))
    errors = PredictionErrors(metrics.registry)
    names = set()
    for fam in metrics.registry.collect():
        names.add(fam.name)
        names.update({f"{fam.name}_{s}" for s in ("total", "bucket", "count", "sum")})
    for h in (errors.ttft_ratio, errors.ttft_s, errors.tpot_ratio, errors.tpot_s):
        names.add(h._name + "_bucket")  # noqa: SLF001 (prometheus_client's own name of a labelled family)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (identifiers followed by ``{``, ``[`` or ``)``/space that are
    not functions or keywords)."""
    words = set(re.findall(r"\b([a-z_:][a-z0-9_:]*)\s*(?=[{\[)]|\s*(?:==|>|<|$))", expr))
    return {w for w in words if w.startswith(("pdserve_", "kube_"))}


def objects(sets: tuple[str, ...], values: tuple[Path, ...] = ()) -> dict[str, dict]:
    if values:
        out = helm_template(values, sets)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    else:
        docs = list(rendered(sets))
    return {o["kind"]: o for o in docs if o["kind"] in ("ConfigMap", "PrometheusRule")
            and o["metadata"]["name"].endswith(("-dashboard", "-alerts"))}


def rule_values(tmp_path: Path, **rule: object) -> Path:
    """A values file setting metrics.prometheusRule (numbers stay numbers: --set would make 0.9 a string)."""
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump({"metrics": {"prometheusRule": rule}}))
    return f


def test_off_by_default():
    assert objects(()) == {}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_dashboard_configmap_is_valid(version):
    kubernetes_validate.validate(objects(ON)["ConfigMap"], version, strict=True)


def test_every_query_names_an_exported_metric():
    known = exported() | KUBE_STATE
    objs = objects(ON)
    cm = objs["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["pdserve.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    rules = objs["PrometheusRule"]["spec"]["groups"][0]["rules"]
    exprs += [r["expr"] for r in rules]
    assert len(exprs) >= 12
    for e in exprs:
        names = metric_names(e)
        assert names and names <= known, (e, names - known)
    assert any("prediction_error" in e for e in exprs[:-len(rules)])  # the dashboard shows the prediction error
    ns = [v for v in dash["templating"]["list"] if v["name"] == "namespace"]
    assert ns[0]["query"] == "llm"  # the release's namespace


def test_alerts_and_their_thresholds_from_the_values(tmp_path):
    values = rule_values(tmp_path, kvUsageThreshold=0.9, predictionErrorRatio=4, restartsPerHour=5)
    rule = objects(ON + ("metrics.prometheusRule.labels.release=kps",), (values,))["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kps"
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(rules) == {"PdserveWorkerDown", "PdserveKVCacheNearFull", "PdservePredictionErrorDrift",
                          "PdserveCrashLoop"}
    assert rules["PdserveWorkerDown"]["expr"].endswith("== 0") and rules["PdserveWorkerDown"]["for"] == "2m"
    assert rules["PdserveKVCacheNearFull"]["expr"].endswith("> 0.9")
    drift = rules["PdservePredictionErrorDrift"]["expr"]
    assert ") > 4)" in drift and ") < 0.25)" in drift
    assert rules["PdserveCrashLoop"]["expr"].endswith(">= 5") and 'pod=~"pd-pdserve-.*"' in rules["PdserveCrashLoop"]["expr"]
    for r in rules.values():  # Prometheus' templates left for Prometheus, not eaten by helm
        assert "{{ $labels." in r["annotations"]["summary"] or "{{ $value" in r["annotations"]["summary"]


@pytest.mark.parametrize("bad", [{"kvUsageThreshold": 1.5}, {"predictionErrorRatio": 0.5},
                                 {"workerDownFor": "soon"}], ids=["kv_over_1", "ratio_under_1", "duration"])
def test_bad_thresholds_are_refused(bad, tmp_path):
    out = helm_template((rule_values(tmp_path, **bad),), ON)
    assert out.returncode != 0 and next(iter(bad)) in out.stderr, out.stderr


def test_tracing_reaches_the_router_and_every_worker_only_when_set(tmp_path):
    def flags(values: tuple[Path, ...]) -> dict[str, tuple[list[str], dict[str, str]]]:
        out = helm_template(values)
        assert out.returncode == 0, out.stderr
        found = {}
        for d in yaml.safe_load_all(out.stdout):
            if not d or d["kind"] != "Deployment":
                continue
            for c in d["spec"]["template"]["spec"]["containers"]:
                if c["name"] in ("router", "vllm"):
                    found[d["metadata"]["name"]] = (c.get("args", []) + c.get("command", []),
                                                    {e["name"]: e.get("value") for e in c.get("env", [])})
        return found

    off = flags(())
    assert off and not any("--otlp-traces-endpoint" in args for args, _ in off.values())
    url = "http://otel-collector.observability.svc:4317"
    on_values = tmp_path / "tracing.yaml"
    on_values.write_text(yaml.safe_dump({"metrics": {"tracing": {"otlpTracesEndpoint": url, "sampleRatio": 0.25}}}))
    on = flags((on_values,))
    assert {n for n in on if "router" in n} and {n for n in on if "prefill" in n} and {n for n in on if "decode" in n}
    for name, (args, env) in on.items():
        i = args.index("--otlp-traces-endpoint")
        assert args[i + 1] == url and env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc", name
        if "router" in name:
            assert args[args.index("--otlp-traces-sample-ratio") + 1] == "0.25"
        else:
            assert env["OTEL_SERVICE_NAME"].startswith("pdserve-")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"metrics": {"tracing": {"sampleRatio": 2}}}))
    out = helm_template((bad,))
    assert out.returncode != 0 and "sampleRatio" in out.stderr
