"""The LoRA adapter list with router replicas and worker restarts (issue 25, item 3's limits): a runtime load
through one replica is listed and routed by every replica of the host (the shared file's ``lora_adapters``
section, beside its ``workers``), a replica that restarts takes the file's list, and a worker that comes back
with only its configured adapters gets the others loaded again before it takes requests."""

from __future__ import annotations

import asyncio
import json

from pdserve.router.api.model_catalog import ModelCatalog
from pdserve.router.app import ROUTER_KEY
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.fleet.shared_adapters import AdapterFile
from pdserve.router.fleet.shared_file import SharedFile
from pdserve.router.fleet.shared_membership import MembershipFile
from tests.unit.test_router_app import Env, model_dir, run, tokenizer  # noqa: F401  (fixtures)
from tests.unit.test_router_lora import LoraWorker

P, D = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def _replica(path, configured: dict[str, str]) -> tuple[ModelCatalog, AdapterFile, MembershipFile]:
    file = SharedFile(path)
    catalog = ModelCatalog("base", "/m", 64, 0, configured, lora=True)
    members = MembershipFile(file, WorkerRegistry((("prefill", P), ("decode", D))), {})
    adapters = AdapterFile(file, catalog)
    members.start()
    adapters.start()
    return catalog, adapters, members


def test_the_adapter_section_is_shared_and_beside_the_workers(tmp_path):
    path = tmp_path / "membership.json"
    cat_a, a, members_a = _replica(path, {"ad": "/ad"})
    cat_b, b, _ = _replica(path, {"ad": "/ad"})
    cat_a.add("new", "/new")  # a load through replica A (it reached every worker)
    assert not a.poll() and b.poll() and cat_b.adapters == {"ad": "/ad", "new": "/new"}
    cat_b.remove("ad")  # an unload through B, of a configured adapter
    assert a.poll() and cat_a.adapters == {"new": "/new"}
    members_a.registry.remove(D)
    members_a.changed(D)  # a membership change keeps the adapter section, and the other way round
    data = json.loads(path.read_text())
    assert data["lora_adapters"] == {"new": "/new"} and sorted(data["workers"]) == [P]
    cat_c, _, _ = _replica(path, {"ad": "/ad"})  # a restarted replica: the file's list, not its --lora-modules
    assert cat_c.adapters == {"new": "/new"}


def _listed(text: str) -> list[str]:
    return [m["id"] for m in json.loads(text)["data"]]


def test_a_runtime_load_is_listed_and_routed_by_every_replica(model_dir, tokenizer, tmp_path):  # noqa: F811
    p, d = LoraWorker("P"), LoraWorker("D")
    shared = dict(enable_lora=True, routers=2, membership_file=str(tmp_path / "membership.json"))

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], **shared) as a, \
                Env(model_dir, tokenizer, [p], [d], **shared) as b:
            st, out = await a.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/a/new"})
            assert st == 200, out
            for _ in range(40):  # b polls the file every 0.5 s
                if "new" in _listed((await b.get("/v1/models"))[1]):
                    break
                await asyncio.sleep(0.1)
            assert _listed((await b.get("/v1/models"))[1]) == ["tiny", "new"]
            st, out = await b.post("/v1/completions", {"model": "new", "prompt": "a", "max_tokens": 2})
            assert st == 200 and out["model"] == "new" and p.requests[-1]["model"] == d.requests[-1]["model"] == "new"
            st, out = await b.post("/v1/unload_lora_adapter", {"lora_name": "new"})
            assert st == 200 and p.adapters == d.adapters == {}
            for _ in range(40):
                if "new" not in _listed((await a.get("/v1/models"))[1]):
                    break
                await asyncio.sleep(0.1)
            st, out = await a.post("/v1/completions", {"model": "new", "prompt": "a", "max_tokens": 2})
            assert st == 404 and out["error"]["code"] == "model_not_found"
    run(main())


def test_a_worker_back_without_its_adapters_gets_them_before_requests(model_dir, tokenizer):  # noqa: F811
    p, d = LoraWorker("P", configured={"ad": "/a/ad"}), LoraWorker("D", configured={"ad": "/a/ad"})

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], lora_modules="ad=/a/ad") as env:
            router = env.app[ROUTER_KEY]
            st, out = await env.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/a/new"})
            assert st == 200 and d.adapters == {"ad": "/a/ad", "new": "/a/new"}
            calls = len(d.lora_calls)
            st, _ = await env.get("/health")
            assert st == 200 and len(d.lora_calls) == calls  # nothing missing: no load
            d.restart()  # the supervisor restarted D: the configured adapter only
            d.lora_status = 500  # and it cannot load the other yet
            st, body = await env.get("/health")
            health = {w["url"]: w for w in json.loads(body)["workers"]}
            assert st == 503 and not health[d.url]["serving"] and "new" in health[d.url]["detail"]
            assert not router.registry[d.url].healthy  # no request reaches it meanwhile
            d.lora_status = None
            st, _ = await env.get("/health")
            assert st == 200 and router.registry[d.url].healthy and d.adapters["new"] == "/a/new"
            assert d.lora_calls[-1] == ("load", {"lora_name": "new", "lora_path": "/a/new"})
            assert router.adapter_sync.reloads == 1 and "ad" not in [b.get("lora_name") for _, b in d.lora_calls]
            st, out = await env.post("/v1/completions", {"model": "new", "prompt": "a", "max_tokens": 2})
            assert st == 200 and d.requests[-1]["model"] == "new"
    run(main())
