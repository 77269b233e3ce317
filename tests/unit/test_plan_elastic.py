"""The elastic cluster shape in the plan simulator: every worker prefills, decodes or both, per request, placed by
the real conductor's elastic path (pdserve.conductor.elastic)."""

import json

import pytest

from pdserve.plan.cli import main
from pdserve.plan.cost import HardwareCostModel, Parallelism
from pdserve.plan.hardware import accelerator, link
from pdserve.plan.kvsize import load_model
from pdserve.plan.results import Targets
from pdserve.plan.search import candidates, elastic_summary, parse_clusters, rank, reason
from pdserve.plan.simulator import Cluster, SimSettings, Simulation
from pdserve.plan.traffic import Request


@pytest.fixture(scope="module")
def cost():
    # Llama-3-8B on one H100: a 16K-token prefill ~0.6 s, a 100-token one ~8 ms, a decode step ~8 ms
    return HardwareCostModel(load_model("llama-3-8b"), accelerator("H100"), link("efa-p5"), Parallelism(1))


def _settings(cost, policy="conductor", handoff="early"):
    return SimSettings(Targets(1.0, 0.05), policy=policy, kv_capacity_tokens=cost.kv_capacity_tokens(),
                       handoff=handoff)


def _bursts(n=12, per=6, gap=1.0, long=16000, short=200, out=256):
    """Every ``gap`` s a burst of ``per`` requests 10 ms apart, every other one a ``long``-token prompt."""
    return [Request(f"b{b}i{i}", b * gap + i * 0.01, long if i % 2 == 0 else short, out)
            for b in range(n) for i in range(per)]


def test_short_prompts_run_colocated_and_long_prompts_split(cost):
    reqs = [Request("s0", 0.0, 100, 32), Request("l0", 0.5, 8000, 32), Request("s1", 1.0, 100, 32),
            Request("l1", 1.5, 8000, 32)]
    sim = Simulation(Cluster(elastic=2), cost, _settings(cost))
    out = sim.run(reqs)
    placed = [(j.req.rid, j.kind, j.prefill_worker, j.decode_worker) for j in sim.jobs]
    assert placed == [("s0", "local", "e0", "e0"), ("l0", "disaggregated", "e0", "e1"),
                      ("s1", "local", "e0", "e0"), ("l1", "disaggregated", "e0", "e1")]
    assert out["decisions"] == {"local": 2, "disaggregated": 2, "reject": 0}
    assert out["config"] == "elastic x2" and set(out["utilization"]) == {"elastic"}
    # the split requests' KV crossed the link once each, with the hand-off after it
    assert out["transfer"]["count"] == 2 and out["transfer"]["handoff_s"] == cost.handoff_s
    l0 = sim.jobs[1]  # early dispatch (the default): the whole transfer after P's prefill, D's intake beside it
    assert l0.gaps[0] >= cost.transfer_s(cost.kv_bytes(8000))
    seq, lw = (Simulation(Cluster(elastic=2), cost, _settings(cost, handoff=h)) for h in ("serial", "layerwise"))
    seq.run(reqs)  # sequential: the whole transfer, then the router's hand-off
    lw.run(reqs)  # layer by layer: at least its last layer's transfer stays after P's prefill
    assert seq.jobs[1].gaps[0] >= cost.transfer_s(cost.kv_bytes(8000)) + cost.handoff_s
    assert seq.jobs[1].gaps[0] > l0.gaps[0] > lw.jobs[1].gaps[0] >= cost.transfer_s(cost.kv_bytes(8000) / cost.layers)


def test_bursty_long_prompts_elastic_tpot_tail_below_colocated(cost):
    reqs = _bursts()
    colo = Simulation(Cluster(colocated=4), cost, _settings(cost)).run(reqs)
    sim = Simulation(Cluster(elastic=4), cost, _settings(cost))
    el = sim.run(reqs)
    # every 16K-token prompt is split off to another worker, every 200-token one runs whole
    assert all((j.kind == "disaggregated") == (j.req.prompt_tokens == 16000) for j in sim.jobs)
    assert all(j.prefill_worker != j.decode_worker for j in sim.jobs if j.kind == "disaggregated")
    assert el["tpot_s"]["p99"] < 0.5 * colo["tpot_s"]["p99"], (el["tpot_s"], colo["tpot_s"])
    # conservation: every request done once, every reservation released on the workers and in the conductor
    assert el["completed"] == len(reqs) and el["rejected"] == 0
    assert all(j.tokens == j.req.output_tokens and len(j.gaps) == j.req.output_tokens - 1 for j in sim.jobs)
    assert sim.conductor.in_flight() == 0
    assert all(w.kv_used == 0 and not w.has_work() for w in sim.workers.values())


def test_elastic_summary_compares_with_the_best_split_and_colocated(cost):
    reqs = _bursts(n=6)
    clusters = [Cluster(colocated=4), Cluster(elastic=4), Cluster(prefill=2, decode=2)]
    ranked = rank([Simulation(c, cost, _settings(cost)).run(reqs) for c in clusters])
    text = elastic_summary(ranked)
    assert text is not None and text.startswith("elastic x4 (18 requests colocated, 18 split)")
    assert "x 2P2D's" in text and "x colocated x4's" in text and "(2P2D: " in text and "; colocated x4: " in text
    # elastic's TPOT tail is a fraction of colocated's, and the summary says so and why
    assert "Why: splitting long prompts keeps their prefills off the workers that decode them" in text
    assert elastic_summary([r for r in ranked if r["config"] != "elastic x4"]) is None


def test_shape_validation_says_what_to_give():
    with pytest.raises(ValueError, match="one shape.*colocated and elastic.*elastic:4"):
        Cluster(colocated=2, elastic=2)
    with pytest.raises(ValueError, match="one shape.*elastic and prefill \\+ decode"):
        Cluster(elastic=2, prefill=1, decode=1)
    with pytest.raises(ValueError, match="elastic=-1"):
        Cluster(elastic=-1)
    with pytest.raises(ValueError, match="give colocated >= 1, elastic >= 1"):
        Cluster(elastic=0)
    assert [c.label for c in parse_clusters("elastic:2, elastic4,Elasticx3,colocated:2,1P1D", 2)] == [
        "elastic x2", "elastic x4", "elastic x3", "colocated x2", "1P1D"]
    assert parse_clusters("elastic:2", 2)[0].devices == 4
    with pytest.raises(ValueError, match="use colocated:N, elastic:N or xPyD"):
        parse_clusters("elastic", 1)
    assert [c.label for c in candidates(3, 1, elastic=True)] == ["colocated x3", "elastic x3", "1P2D", "2P1D"]
    assert "elastic x1" not in [c.label for c in candidates(2, 1, all_sizes=True, elastic=True)]


def test_elastic_needs_the_conductor_policy(cost, capsys):
    with pytest.raises(ValueError, match="use --policy conductor"):
        Simulation(Cluster(elastic=2), cost, _settings(cost, policy="round_robin"))
    base = ["--model", "llama-3-8b", "--hardware", "H100", "--network", "efa-p5", "--gpus", "2", "--rate", "2",
            "--lengths", "1000:20", "--requests", "20"]
    assert main(base + ["--policy", "round_robin", "--configs", "elastic:2"]) == 2
    assert "use --policy conductor" in capsys.readouterr().err
    assert main(base + ["--policy", "round_robin", "--json"]) == 0  # the baseline search leaves elastic out
    assert "elastic x2" not in {c["config"] for c in json.loads(capsys.readouterr().out)["candidates"]}


def test_cli_lists_elastic_rows_and_says_what_they_do(capsys):
    args = ["--model", "llama-3-8b", "--hardware", "H100", "--network", "efa-p5", "--gpus", "4", "--rate", "6",
            "--lengths", "0.5:16000:128,0.5:200:128", "--requests", "60", "--ttft", "1", "--tpot", "0.03",
            "--top", "1"]
    assert main(args) == 0
    text = capsys.readouterr().out
    rows = [line.split()[0:2] for line in text.splitlines() if line.strip().startswith(("elastic", "colocated"))]
    assert ["elastic", "x4"] in rows and ["colocated", "x4"] in rows  # listed even below --top 1
    assert "util P/D or C/E" in text
    assert ("elastic roles: elastic x4" in text) != text.split("recommended: ")[1].startswith("elastic")
    assert main(args + ["--configs", "elastic:4,colocated:4,2P2D", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    el = next(c for c in out["candidates"] if c["config"] == "elastic x4")
    assert el["devices"] == 4 and el["decisions"]["disaggregated"] > 0 and el["decisions"]["local"] > 0
    assert out["elastic"].startswith("elastic x4 (")


def _result(config, goodput, slo, ttft, tpot, decisions=(0, 0), split=None, transfer=None):
    r = {"config": config, "goodput_rps": goodput, "slo_attainment": slo,
         "ttft_s": dict(zip(("p50", "p90", "p99"), ttft)), "tpot_s": {"p50": tpot[0], "p90": tpot[0], "p99": tpot[1]},
         "decisions": {"local": decisions[0], "disaggregated": decisions[1], "reject": 0}}
    if split is not None:
        r["split_prefills"] = split
    if transfer is not None:
        r["transfer"] = {"count": decisions[1], "mean_bytes": 1.0, "mean_s": transfer, "handoff_s": 0.005}
    return r


def test_an_elastic_pick_is_explained_against_both_fixed_shapes():
    el = _result("elastic x4", 1.12, 0.56, (3.7, 12.0, 42.5), (0.030, 0.752), (36, 964),
                 {"e0": 700, "e1": 100, "e2": 100, "e3": 100}, transfer=0.0586)
    pd = _result("3P1D", 0.73, 0.37, (7.4, 20.0, 32.1), (0.031, 0.100))
    co = _result("colocated x4", 0.51, 0.26, (2.8, 9.0, 25.4), (0.075, 1.253))
    ranked = rank([pd, co, el])
    assert [r["config"] for r in ranked] == ["elastic x4", "3P1D", "colocated x4"]
    assert reason(ranked, []) == elastic_summary(ranked) == (
        "elastic x4 (36 requests colocated, 964 split): goodput 1.12 req/s, 1.53x 3P1D's, 2.20x colocated x4's; "
        "TPOT p99 752 ms, TTFT p50/p99 3700/42500 ms (3P1D: 100 ms, TTFT p50/p99 7400/32100 ms; colocated x4: "
        "1253 ms, TTFT p50/p99 2800/25400 ms). Why: splitting long prompts keeps their prefills off the workers "
        "that decode them (TPOT p99 1253 ms colocated -> 752 ms); all 4 workers prefill, so the typical request "
        "starts sooner than on 3P1D's 3 prefill worker(s) (TTFT p50 3700 vs 7400 ms), but the tail queues (TTFT "
        "p99 42500 vs 32100 ms); the conductor sends split prefills to the workers with the fewest decodes to "
        "stall, so they queue there (e0 prefilled 700 of 1000, an even share is 250); yet more requests meet both "
        "targets (56% vs 37%): the queueing falls on the longest prompts, which the placement sends where they "
        "stall the fewest decodes, while shorter ones take the free workers; decodes on elastic workers still share "
        "steps with prefills, which 3P1D's decode workers never do (TPOT p99 752 vs 100 ms); each split also pays "
        "a 58.6 ms KV transfer + 5.0 ms hand-off.")
    # a pool that never split says so, and with no split configuration only colocated is compared
    none_split = _result("elastic x4", 0.5, 0.5, (1.0, 1.0, 2.0), (0.03, 1.2), (100, 0))
    assert elastic_summary([co, none_split]).endswith(
        "Why: no prompt was long enough to split, so the pool ran as colocated workers.")
