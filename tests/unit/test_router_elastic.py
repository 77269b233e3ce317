"""The router's elastic pool (``--elastic URL...``): config, registry roles, and per-request colocated / split
placement against fake workers."""

from __future__ import annotations

import json

import pytest

from pdserve.router.__main__ import config_from_args
from pdserve.router.config import RouterConfig, RouterConfigError
from pdserve.router.fleet.registry import WorkerRegistry, role_of
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

A, B = "http://127.0.0.1:8101", "http://127.0.0.1:8102"


def test_config_elastic_alone_is_disaggregated_with_both_roles(model_dir):
    c = config_from_args(["--model-dir", str(model_dir), "--elastic", A, B + "/", "--policy", "conductor"])
    assert c.elastic == (A, B) and c.mode == "disaggregated"
    assert c.all_workers() == [("prefill", A), ("decode", A), ("elastic", A),
                               ("prefill", B), ("decode", B), ("elastic", B)]


def test_config_elastic_errors_say_how_to_fix(model_dir):
    with pytest.raises(RouterConfigError, match="--elastic cannot be combined with --prefill"):
        RouterConfig(model_dir=str(model_dir), elastic=(A,), prefill=(B,), decode=(B,))
    with pytest.raises(RouterConfigError, match="--elastic cannot be combined"):
        RouterConfig(model_dir=str(model_dir), elastic=(A,), colocated=(B,))
    with pytest.raises(RouterConfigError, match="--elastic 'localhost:1'"):
        RouterConfig(model_dir=str(model_dir), elastic=("localhost:1",))
    with pytest.raises(RouterConfigError, match="or --elastic URL"):
        RouterConfig(model_dir=str(model_dir))


def test_registry_role_of_elastic():
    reg = WorkerRegistry([("prefill", A), ("decode", A), ("elastic", A)])
    assert role_of(reg[A].roles) == "elastic"
    assert role_of({"prefill", "decode"}) == "both"  # a URL under --prefill and --decode stays as before


def test_elastic_pool_places_short_colocated_and_long_split(model_dir, tokenizer):
    w0, w1 = FakeWorker("E0"), FakeWorker("E1")

    async def main():
        async with Env(model_dir, tokenizer, policy="conductor", calibrate=False, local_prefill_tokens=8,
                       elastic=(w0, w1)) as env:
            first, second = sorted([w0, w1], key=lambda w: w.url)
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3})
            assert st == 200 and out["choices"][0]["text"] == " b c w15"
            assert len(first.requests) == 1 and second.requests == []  # short, idle pool: colocated
            assert "kv_transfer_params" not in first.requests[0]
            st, out = await env.post("/v1/completions", {"prompt": " ".join(["a"] * 20), "max_tokens": 3})
            assert st == 200
            # long (20 uncached tokens > 8): split, P on one worker and D on the other
            p_req = first.requests[1]
            d_req = second.requests[0]
            assert p_req["max_tokens"] == 1 and p_req["kv_transfer_params"]["do_remote_decode"] is True
            assert d_req["kv_transfer_params"]["remote_engine_id"] == first.name
            st, body = await env.get("/ready")
            assert st == 200 and json.loads(body)["status"] == "ready"
            st, body = await env.get("/v1/pdserve/workers")
            assert st == 200 and [w["roles"] for w in json.loads(body)["workers"]] == [["decode", "elastic", "prefill"]] * 2
            _, metrics = await env.get("/metrics")
            assert 'pdserve_conductor_decisions_total{kind="local"} 1' in metrics
            assert 'pdserve_conductor_decisions_total{kind="disaggregated"} 1' in metrics
    run(main())
