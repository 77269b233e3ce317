"""The one Prometheus reader (pdserve.prom on prometheus_client's parser) and the router's per-app registries."""

from __future__ import annotations

from pdserve.bench.prom import delta
from pdserve.conductor import ConductorConfig
from pdserve.prom import label_values, parse, types
from pdserve.router.fleet.load_probe import parse_vllm_metrics
from pdserve.router.fleet.placement import make_placement
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.metrics import ConductorCollector, RouterMetrics

PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 120.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.79e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="512",path="a \\"b\\" \\\\c"} 1.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0"} 3.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 4.0
vllm:e2e_request_latency_seconds_sum 5.5 1700000000000
vllm:e2e_request_latency_seconds_count 4.0
untyped_thing 7
"""


def test_parse_sums_per_name_and_keeps_label_sets_on_request():
    sums = parse(PAGE, "vllm:")
    assert sums["vllm:num_requests_running"] == 3.0
    assert sums["vllm:prefix_cache_queries_total"] == 120.0
    assert sums["vllm:e2e_request_latency_seconds_bucket"] == 7.0
    assert sums["vllm:e2e_request_latency_seconds_sum"] == 5.5  # a timestamp is not the value
    assert "untyped_thing" not in sums and parse(PAGE)["untyped_thing"] == 7.0
    keyed = parse(PAGE, "vllm:num_requests_running", labels=True)
    assert keyed == {'vllm:num_requests_running{engine="0",model_name="m"}': 2.0,
                     'vllm:num_requests_running{engine="1",model_name="m"}': 1.0}
    (info,) = parse(PAGE, "vllm:cache_config_info", labels=True)
    assert label_values(info) == {"block_size": "16", "num_gpu_blocks": "512", "path": 'a "b" \\c'}
    assert label_values("plain_name") == {}


def test_types_as_declared():
    t = types(PAGE)
    assert t["vllm:num_requests_running"] == "gauge"
    assert t["vllm:prefix_cache_queries_total"] == "counter"
    assert t["vllm:prefix_cache_queries_created"] == "gauge"
    assert t["vllm:e2e_request_latency_seconds"] == "histogram"


def test_malformed_text_keeps_what_came_before():
    assert parse("a 1\nb notanumber\nc 3\n") == {"a": 1.0}
    assert parse("") == {}


def test_load_probe_reads_capacity_and_load():
    r = parse_vllm_metrics(PAGE)
    assert r.running == 3 and r.kv_capacity_tokens == 16 * 512 and r.prefix_cache_queries == 120.0


def test_router_metrics_round_trip_and_apps_do_not_share_numbers():
    a, b = RouterMetrics(), RouterMetrics()
    a.requests.labels("completions", "200").inc()
    a.handoffs.labels("kv").inc(2)
    a.observe_timings("disaggregated", {"ttft_ms": 120.0, "kv_transfer_bytes": 4096})
    rr = make_placement(WorkerRegistry([("prefill", "http://p"), ("decode", "http://d")]),
                        ConductorConfig(policy="round_robin"), 0)
    a.registry.register(ConductorCollector(rr, lambda: {"http://d": 3}))
    rr.choose([1, 2, 3])
    sa, sb = parse(a.render(), labels=True), parse(b.render(), labels=True)
    assert sa['pdserve_router_requests_total{endpoint="completions",status="200"}'] == 1.0
    assert sa['pdserve_router_handoffs_total{outcome="kv"}'] == 2.0
    assert sa['pdserve_router_phase_seconds_count{mode="disaggregated",phase="ttft"}'] == 1.0
    assert sa['pdserve_router_phase_seconds_bucket{le="0.15",mode="disaggregated",phase="ttft"}'] == 1.0
    assert sa['pdserve_router_phase_seconds_bucket{le="0.1",mode="disaggregated",phase="ttft"}'] == 0.0
    assert sa["pdserve_router_kv_transfer_bytes_count"] == 1.0
    assert sa['pdserve_worker_queued_prefill_tokens{role="prefill",worker="http://p"}'] == 3.0
    assert sa['pdserve_worker_running_requests{role="decode",worker="http://d"}'] == 1.0
    assert sa['pdserve_conductor_decisions_total{kind="disaggregated"}'] == 1.0
    assert sa['pdserve_conductor_kv_event_batches_total{worker="http://d"}'] == 3.0
    assert sa["pdserve_conductor_decision_seconds_count"] == 1.0
    assert not any(k.startswith(("pdserve_router_requests_total", "pdserve_worker_")) for k in sb)
    t = types(a.render())
    assert t["pdserve_router_requests_total"] == "counter" and t["pdserve_router_phase_seconds"] == "histogram"
    assert t["pdserve_worker_kv_usage"] == "gauge" and t["pdserve_conductor_decisions_total"] == "counter"
    assert t["pdserve_router_inflight_requests"] == "gauge" and t["pdserve_conductor_decision_seconds"] == "histogram"
    assert delta({"x": 1.0}, {"x": 3.0, "y": 1.0}) == {"x": 2.0, "y": 1.0}
