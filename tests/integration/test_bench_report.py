"""`pdserve bench` end to end against a live 1P1D stack (tiny random-weight Llama; the one test_pd_router.py uses,
shared): a trace replay, an agent workload and a Poisson run produce records with the router's phases, the KV read
counters, and a report."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pdserve.bench import cli
from pdserve.bench.compare import WorkloadPlan, run_on_cluster
from pdserve.bench.metrics import SLO
from pdserve.bench.report import slug, write_report

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(600),
]  # shares pd_cluster (tests/conftest.py: SHARED_STACKS)


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster


def test_compare_on_live_1p1d_writes_report(cluster, tmp_path, tmp_trace):
    plans = [WorkloadPlan("conv@4", f"trace:path={tmp_trace},input_scale=0.25,output_scale=0.1,max_output=8",
                          {"rate": 4.0, "seed": 0}),
             WorkloadPlan("agent", "agent:sessions=2,turns=3,rate=2,system=128,user=16,tool=64,output=4", {"seed": 1})]
    results = {"configs": {}, "order": ["1p1d"], "workloads": [p.label for p in plans], "cores": [0, 1],
               "slo": {"ttft_ms": 5000, "tpot_ms": 1000}}

    def save(label, result):
        (tmp_path / "raw").mkdir(exist_ok=True)
        (tmp_path / "raw" / f"1p1d__{slug(label)}.json").write_text(json.dumps(result.to_dict()))

    per_wl = run_on_cluster(cluster, plans, SLO(5000, 1000), {"progress": False}, on_result=save,
                            max_model_len=2048)
    results["configs"]["1p1d"] = {"startup_s": 0.0, "workers": 2, "workloads": per_wl}
    conv, agent = per_wl["conv@4"], per_wl["agent"]
    assert conv["requests"] == 6 and conv["errors"] == 0 and agent["requests"] == 6 and agent["errors"] == 0
    assert conv["ttft_p50_ms"] > 0 and conv["tpot_p99_ms"] > 0 and conv["goodput_req_per_s"] > 0
    assert conv["modes"] == {"disaggregated": 6} and conv["prefill_p50_ms"] > 0
    assert conv["kv_reads"] >= 6 and conv["kv_read_mean_bytes"] > 0  # D read the prompt KV from P
    assert agent["prompt_tokens_mean"] > 144  # later turns carry the earlier context
    write_report(results, tmp_path, command="test")
    md = (tmp_path / "report.md").read_text()
    assert "**1p1d** wins" in md and "| 1p1d |" in md
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "cdf_conv@4.png").stat().st_size > 1000


def test_cli_run_against_router_url(cluster, tmp_path, capsys):
    rc = cli.main(["run", "--url", cluster.router_url, "--vocab-size", "49152", "--no-progress",
                   "--workload", "poisson:rate=20,requests=4,input=64,output=4,name=p", "--slo-ttft-ms", "5000",
                   "--out", str(tmp_path)])
    assert rc == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = line["workloads"]["p"]
    assert row["requests"] == 4 and row["errors"] == 0 and row["goodput_req_per_s"] > 0
    assert json.loads((tmp_path / "raw" / "run__p.json").read_text())["records"][0]["output_tokens"] == 4


@pytest.fixture
def tmp_trace(tmp_path):
    rows = [{"timestamp": t, "input_length": n, "output_length": 40, "hash_ids": ids}
            for t, n, ids in [(0, 700, [0, 1]), (0, 900, [0, 2]), (500, 400, [3]), (1000, 1000, [0, 1]),
                              (1200, 300, [4]), (2000, 600, [0, 5])]]
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return p


def test_cli_run_against_plain_vllm(cluster, tmp_path, capsys):
    """Any OpenAI-compatible URL: the decode worker's own vLLM server, no router in front (it ignores
    pdserve_timings, so the phase columns stay empty)."""
    url = cluster.worker_urls("decode")[0]
    rc = cli.main(["run", "--url", url, "--vocab-size", "49152", "--no-progress",
                   "--workload", "fixed:rate=10,requests=3,input=32,output=5,name=v"])
    assert rc == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["workloads"]["v"]
    assert row["requests"] == 3 and row["errors"] == 0 and row["tpot_p50_ms"] > 0
    assert "prefill_p50_ms" not in row
