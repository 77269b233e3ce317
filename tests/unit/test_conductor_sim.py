"""64 simulated workers (pdserve.plan's discrete-event simulator, every placement made by the real conductor,
workers timed by the conductor's own cost model) replaying a slice of the Mooncake conversation trace: the
conductor finds far more cached prefix than round-robin, and first tokens come sooner."""

from __future__ import annotations

import statistics

from pdserve.bench.traces import default_trace
from pdserve.conductor import OnlineCostModel
from pdserve.conductor.cost_model import Priors


def _cost() -> OnlineCostModel:
    return OnlineCostModel(131072, Priors(prefill=(0.02, 6e-5, 2e-10), decode=(0.015, 2e-4, 2e-8),
                                          bandwidth_bytes_s=25e9, transfer_overhead_s=0.001, handoff_s=0.005))


def test_conductor_beats_round_robin_on_trace_with_64_workers():
    from pdserve.plan.results import Targets
    from pdserve.plan.simulator import Cluster, SimSettings, Simulation
    from pdserve.plan.traffic import load_trace

    reqs = load_trace(default_trace(), rate=12.0, limit=500)
    out = {}
    for policy in ("round_robin", "conductor"):
        sim = Simulation(Cluster(prefill=32, decode=32), _cost(),
                         SimSettings(Targets(2.0, 0.1), policy=policy, kv_capacity_tokens=2_000_000))
        summary = sim.run(reqs)
        assert summary["completed"] == len(reqs) and summary["rejected"] == 0  # nothing lost or doubled
        hit = sum(max(0, j.cached) for j in sim.jobs) / sum(j.req.prompt_tokens for j in sim.jobs)
        ttft = statistics.mean(j.first_token_s - j.req.arrival_s for j in sim.jobs)
        out[policy] = (hit, ttft)
    (rr_hit, rr_ttft), (c_hit, c_ttft) = out["round_robin"], out["conductor"]
    assert c_hit >= 2 * rr_hit, out
    assert c_ttft < rr_ttft, out
