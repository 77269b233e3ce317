"""Per-run KV figures from workers' counter snapshots (pdserve/bench/kv_counters.py), for each data plane and pool."""

from __future__ import annotations

from pdserve.bench.kv_counters import kv_figures

SRC = "vllm:prompt_tokens_by_source_total"


def _src(source: str) -> str:
    return SRC + '{engine="0",model_name="m",source="' + source + '"}'


def test_pdserve_plane_and_pool():
    before = {"prefill": {_src("local_compute"): 100.0}, "decode": {}}
    after = {
        "prefill": {_src("local_compute"): 1100.0, _src("external_kv_transfer"): 512.0,
                    _src("local_cache_hit"): 256.0, "vllm:pdserve_kv_pool_load_bytes_total": 4e6,
                    "vllm:pdserve_kv_pool_loaded_tokens_total": 512.0,
                    "vllm:pdserve_kv_pool_save_bytes_total": 8e6,
                    "vllm:pdserve_kv_pool_load_seconds_total": 0.002, "vllm:pdserve_kv_pool_save_seconds_total": 0.016},
        "decode": {_src("external_kv_transfer"): 1500.0, "vllm:pdserve_kv_read_bytes_total": 3e6},
    }
    f = kv_figures(before, after, requests=3)
    assert f["kv_bytes_per_request"] == 1e6
    assert (f["prefill_tokens_computed"], f["prefix_cache_tokens"], f["pool_hit_tokens"]) == (1000, 256, 512)
    assert f["prefill_external_tokens"] == 512
    assert (f["pool_get_bytes"], f["pool_put_bytes"]) == (4_000_000, 8_000_000)
    assert (f["pool_get_gbps"], f["pool_put_gbps"]) == (2.0, 0.5)  # its get and put calls' own seconds
    untimed = {"prefill": {"vllm:pdserve_kv_pool_save_bytes_total": 8e6}}  # a worker from before the timers
    assert kv_figures({}, untimed, 1)["pool_put_gbps"] is None


def test_nixl_and_mooncake_planes_take_the_larger_side():
    nixl = kv_figures({}, {"prefill": {}, "decode": {'vllm:nixl_bytes_transferred_sum{engine="0"}': 2e6,
                                                     'vllm:nixl_bytes_transferred_count{engine="0"}': 2.0}}, 2)
    assert nixl["kv_bytes_per_request"] == 1e6
    both = {"prefill": {"vllm:pdserve_mooncake_kv_bytes_total": 4e6},
            "decode": {"vllm:pdserve_mooncake_kv_bytes_total": 4e6}}
    assert kv_figures({}, both, 4)["kv_bytes_per_request"] == 1e6  # counted on both sides: not twice


def test_mooncake_store_rates():
    op = "vllm:mooncake_store_operation_"
    after = {"prefill": {op + 'bytes_total{operation="save_put",status="success"}': 2e9,
                         op + 'time_seconds_sum{operation="save_put",status="success"}': 4.0,
                         _src("external_kv_transfer"): 128.0},
             "decode": {op + 'bytes_total{operation="load_get",status="success"}': 3e9,
                        op + 'time_seconds_sum{operation="load_get",status="success"}': 1.5,
                        op + 'keys_total{operation="load_get",status="success"}': 3.0,
                        op + 'time_seconds_count{operation="load_get",status="success"}': 7.0}}
    f = kv_figures({}, after, 1)
    assert (f["pool_put_gbps"], f["pool_get_gbps"], f["prefill_external_tokens"]) == (0.5, 2.0, 128)
    assert f["pool_hit_tokens"] == 3 * 128  # D's loads from the store count too
    assert f["kv_bytes_per_request"] == 0.0
    assert kv_figures({}, after, 0)["kv_bytes_per_request"] is None
