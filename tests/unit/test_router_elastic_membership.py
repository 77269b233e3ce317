"""Role ``elastic`` in the membership API (POST /v1/pdserve/workers) and in discovery (--elastic-dns): an elastic
router (``--elastic`` or ``--mode elastic``) takes only elastic workers, other routers refuse them, with a 400 that
says why; an elastic worker that joins is placed per request like one given on the command line."""

from __future__ import annotations

import json

import pytest

from pdserve.kube.discovery import DiscoveryConfig, DiscoveryConfigError, PoolTarget, Reconciler, config_from_args
from pdserve.router.config import RouterConfig, RouterConfigError
from pdserve.router.fleet.registry import WorkerRegistry, role_of
from tests.unit.test_helm_discovery import Clock, FakeDns, FakeRouter, u
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

PATH = "/v1/pdserve/workers"
A = "http://127.0.0.1:8101"


def test_registry_add_elastic_gives_every_role_at_once():
    seen = []

    class Listener:
        def worker_added(self, w):
            seen.append(role_of(w.roles))

        def worker_removed(self, url):
            pass

        def health_changed(self, w):
            pass

    reg = WorkerRegistry()
    reg.subscribe(Listener())
    w = reg.add(A, "elastic")
    assert w.roles == {"prefill", "decode", "elastic"} and seen == ["elastic"]  # never seen with a fixed role


def test_router_mode_elastic_starts_empty_and_contradicts_fixed_roles(model_dir):
    c = RouterConfig(model_dir=str(model_dir), mode_hint="elastic")
    assert (c.is_elastic, c.mode, c.all_workers()) == (True, "disaggregated", [])
    assert RouterConfig(model_dir=str(model_dir), elastic=(A,)).is_elastic
    assert not RouterConfig(model_dir=str(model_dir), mode_hint="disaggregated").is_elastic
    with pytest.raises(RouterConfigError, match="--mode elastic contradicts --prefill/--decode/--colocated"):
        RouterConfig(model_dir=str(model_dir), mode_hint="elastic", colocated=(A,))
    with pytest.raises(RouterConfigError, match="colocated, disaggregated or elastic"):
        RouterConfig(model_dir=str(model_dir), mode_hint="mixed")


def test_membership_elastic_role_in_elastic_and_other_routers(model_dir, tokenizer):
    w0, w1 = FakeWorker("E0"), FakeWorker("E1")

    async def main():
        await w0.start()
        await w1.start()
        try:
            async with Env(model_dir, tokenizer, policy="conductor", calibrate=False, local_prefill_tokens=8,
                           mode_hint="elastic") as env:
                for role in ("prefill", "decode", "colocated", None):
                    st, out = await env.post(PATH, {"url": w0.url, "role": role})
                    assert st == 400 and out["error"]["param"] == "role"
                    assert out["error"]["message"] == (
                        f"role {role!r}: this router is elastic (started with --elastic or --mode elastic): its "
                        "workers have no fixed role, register them with role elastic")
                for w in (w0, w1):
                    st, out = await env.post(PATH, {"url": w.url, "role": "elastic"})
                    assert st == 201 and out == {"added": w.url, "roles": ["decode", "elastic", "prefill"]}
                st, body = await env.get(PATH)
                assert st == 200 and json.loads(body)["elastic"] is True
                first, second = sorted([w0, w1], key=lambda w: w.url)
                st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3})
                assert st == 200 and len(first.requests) == 1 and second.requests == []  # colocated
                st, out = await env.post("/v1/completions", {"prompt": " ".join(["a"] * 20), "max_tokens": 3})
                assert st == 200 and len(first.requests) == 2 and len(second.requests) == 1  # split P -> D
                st, body = await env.get(PATH)
                assert json.loads(body)["placements"] == {"colocated": 1, "chunked": 0, "split": 1}
            async with Env(model_dir, tokenizer, mode_hint="disaggregated") as env:
                st, out = await env.post(PATH, {"url": w0.url, "role": "elastic"})
                assert st == 400 and out["error"]["message"] == (
                    "role 'elastic' needs a router started in elastic mode (--elastic URL... or --mode elastic); "
                    "this router is disaggregated: use role prefill or decode")
            async with Env(model_dir, tokenizer, colocated=[FakeWorker("C")]) as env:
                st, out = await env.post(PATH, {"url": w0.url, "role": "elastic"})
                assert st == 400 and "this router is colocated: use role colocated" in out["error"]["message"]
        finally:
            await w0.stop()
            await w1.stop()
    run(main())


def test_discovery_follows_an_elastic_pool():
    pool = PoolTarget("elastic", "pd-elastic.ns.svc", 8000)
    router, dns = FakeRouter(), FakeDns()
    dns.answers = {pool.host: {"10.0.0.1", "10.0.0.2"}}
    rec = Reconciler(DiscoveryConfig(router="http://127.0.0.1:8000", pools=(pool,), absent_rounds=1), router, dns,
                     Clock())
    assert rec.step().added == [(u("10.0.0.1"), "elastic"), (u("10.0.0.2"), "elastic")]
    # the router lists an elastic worker under all three roles: it is managed, nothing is added twice
    router.members = {url: {"prefill", "decode", "elastic"} for url in router.members}
    assert not rec.step().changed
    dns.answers[pool.host] = {"10.0.0.2"}
    assert rec.step().removed == [u("10.0.0.1")]


def test_discovery_elastic_dns_flag_and_errors():
    cfg, _ = config_from_args(["--router", "http://127.0.0.1:8000", "--elastic-dns", "pd-elastic.ns.svc:8000"])
    assert cfg.pools == (PoolTarget("elastic", "pd-elastic.ns.svc", 8000),)
    with pytest.raises(DiscoveryConfigError, match="--elastic-dns with --prefill-dns/--decode-dns"):
        config_from_args(["--router", "http://127.0.0.1:8000", "--elastic-dns", "e.svc:8000",
                          "--decode-dns", "d.svc:8000"])
