"""LoRA adapters through the router against fake workers (issue 25, item 3): /v1/models lists them, model=<adapter>
reaches P and D unchanged and names the answer, the conductor routes by adapter and prefix (real ZMQ KV events),
and /v1/load_lora_adapter / /v1/unload_lora_adapter reach every worker, all or none."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
import zmq
from aiohttp import web

from pdserve.launch.procs import free_port
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

ADAPTERS = "ad=/adapters/ad,other=/adapters/other"


class LoraWorker(FakeWorker):
    """A fake worker that also serves vLLM's load / unload endpoints and lists its adapters in /v1/models
    (``lora_status``: answer loads with this HTTP error instead; ``configured``: what it loads at start, and again
    after :meth:`restart`)."""

    def __init__(self, name: str, lora_status: int | None = None, configured: dict[str, str] | None = None,
                 **kw: Any) -> None:
        super().__init__(name, **kw)
        self.lora_status = lora_status
        self.configured = dict(configured or {})
        self.adapters: dict[str, str] = dict(self.configured)
        self.lora_calls: list[tuple[str, dict]] = []

    def restart(self) -> None:
        """What a supervisor's restart leaves: the configured adapters only."""
        self.adapters = dict(self.configured)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}] + [
            {"id": name, "root": path, "parent": "tiny"} for name, path in self.adapters.items()]})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.lora_calls.append(("load", body))
        if self.lora_status is not None:
            return web.json_response({"error": {"message": f"no adapter at {body['lora_path']}", "type": "x",
                                                "param": None, "code": self.lora_status}}, status=self.lora_status)
        self.adapters[body["lora_name"]] = body["lora_path"]
        return web.Response(text="Success")

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.lora_calls.append(("unload", body))
        if self.adapters.pop(body["lora_name"], None) is None:
            return web.json_response({"error": {"message": "cannot be found", "type": "NotFoundError",
                                                "param": None, "code": 404}}, status=404)
        return web.Response(text="Success")

    async def start(self) -> LoraWorker:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self


async def _models(env: Env) -> dict[str, Any]:
    st, text = await env.get("/v1/models")
    assert st == 200
    return {m["id"]: m for m in json.loads(text)["data"]}


def test_models_lists_adapters_and_model_reaches_p_and_d(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], lora_modules=ADAPTERS) as env:
            models = await _models(env)
            assert list(models) == ["tiny", "ad", "other"]
            assert models["ad"]["parent"] == "tiny" and models["ad"]["root"] == "/adapters/ad"
            assert models["tiny"]["parent"] is None
            body = {"model": "ad", "prompt": "the cat sat", "max_tokens": 3, "ignore_eos": True}
            st, out = await env.post("/v1/completions", body)
            assert st == 200 and out["model"] == "ad", out
            assert p.requests[-1]["model"] == "ad" and d.requests[-1]["model"] == "ad"  # both run the adapter
            st, events = await env.stream("/v1/chat/completions", {
                "model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
            assert st == 200 and {json.loads(e)["model"] for e in events} == {"other"}
            assert p.requests[-1]["model"] == "other" and d.requests[-1]["model"] == "other"
            st, out = await env.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2})
            assert st == 200 and out["model"] == "tiny"
            assert "model" not in p.requests[-1] and "model" not in d.requests[-1]  # the base model: vLLM's default
            st, out = await env.post("/v1/completions", {"model": "nope", "prompt": "a", "max_tokens": 2})
            assert st == 404 and out["error"]["code"] == "model_not_found" and out["error"]["param"] == "model"
            st, out = await env.post("/v1/messages", {"model": "ad", "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": "hi"}]})
            assert st == 200 and out["model"] == "ad" and p.requests[-1]["model"] == "ad"
            st, out = await env.post("/v1/responses", {"model": "ad", "input": "hi", "max_output_tokens": 3})
            assert st == 200 and out["model"] == "ad" and d.requests[-1]["model"] == "ad"
            st, out = await env.post("/tokenize", {"model": "ad", "prompt": "the cat"})  # as the base model
            assert st == 200 and out["tokens"] == tokenizer.encode("the cat", True), out
            assert (await env.post("/tokenize", {"model": "nope", "prompt": "a"}))[0] == 404
    run(main())


def test_prompt_scoring_is_refused_with_lora_on_and_reaches_no_worker(model_dir, tokenizer):
    """vLLM 0.32's engine dies on prompt_logprobs with LoRA on (a batch of two): the router answers 400 first."""
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], lora_modules=ADAPTERS) as env:
            for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}, {"prompt_logprobs": 0}):
                before = len(p.requests) + len(d.requests)
                st, out = await env.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2,
                                                             **extra})
                assert st == 400 and out["error"]["param"] == "prompt_logprobs", out
                assert len(p.requests) + len(d.requests) == before
            st, out = await env.post("/v1/completions", {"model": "ad", "prompt": "a", "max_tokens": 2, "logprobs": 1})
            assert st == 200, out  # output logprobs are not prompt scoring
    run(main())


def test_lora_routes_absent_without_lora(model_dir, tokenizer):
    async def main():
        async with Env(model_dir, tokenizer, colocated=[FakeWorker("W")]) as env:
            assert list(await _models(env)) == ["tiny"]
            st, out = await env.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
            assert st == 404
            st, out = await env.post("/v1/completions", {"model": "ad", "prompt": "a", "max_tokens": 2})
            assert st == 404 and out["error"]["code"] == "model_not_found"
    run(main())


def test_load_and_unload_reach_every_worker(model_dir, tokenizer):
    p, d = LoraWorker("P"), LoraWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], enable_lora=True) as env:
            assert list(await _models(env)) == ["tiny"]
            st, out = await env.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/a/new"})
            assert st == 200 and "added" in out
            assert p.adapters == d.adapters == {"new": "/a/new"}
            assert (await _models(env))["new"]["parent"] == "tiny"
            st, out = await env.post("/v1/completions", {"model": "new", "prompt": "a", "max_tokens": 2})
            assert st == 200 and out["model"] == "new" and d.requests[-1]["model"] == "new"
            st, out = await env.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/a/new"})
            assert st == 400 and "already been loaded" in out["error"]["message"]
            st, out = await env.post("/v1/load_lora_adapter", {"lora_name": "x"})
            assert st == 400 and out["error"]["param"] == "lora_path"
            st, out = await env.post("/v1/unload_lora_adapter", {"lora_name": "new"})
            assert st == 200 and p.adapters == d.adapters == {}
            assert list(await _models(env)) == ["tiny"]
            st, out = await env.post("/v1/completions", {"model": "new", "prompt": "a", "max_tokens": 2})
            assert st == 404
            st, out = await env.post("/v1/unload_lora_adapter", {"lora_name": "new"})
            assert st == 404 and "cannot be found" in out["error"]["message"]
    run(main())


def test_partial_load_failure_names_the_worker_and_lists_nothing(model_dir, tokenizer):
    p, d = LoraWorker("P"), LoraWorker("D", lora_status=500)
    gone = FakeWorker("gone")

    async def main():
        await gone.start()
        async with Env(model_dir, tokenizer, [p], [d], enable_lora=True) as env:
            st, out = await env.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/a/bad"})
            assert st == 502, out
            msg = out["error"]["message"]
            assert d.url in msg and p.url not in msg.split("failed on")[1].split("unloaded")[0]
            assert "1 of 2" in msg and "unloaded again from 1 worker" in msg
            assert p.adapters == {} and ("unload", {"lora_name": "bad"}) in p.lora_calls  # all or none
            assert "bad" not in await _models(env)
            st, out = await env.post("/v1/completions", {"model": "bad", "prompt": "a", "max_tokens": 2})
            assert st == 404
            d.lora_status = 404  # every worker agrees on a 4xx: vLLM's status and message come through
            p.lora_status = 404
            st, out = await env.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/a/none"})
            assert st == 404 and "no adapter at /a/none" in out["error"]["message"]
        # a worker that does not answer at all is named too
        async with Env(model_dir, tokenizer, [LoraWorker("P2")], [gone], enable_lora=True) as env:
            url = gone.url
            await gone.stop()
            st, out = await env.post("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "/a/z"})
            assert st == 502 and url in out["error"]["message"] and "no answer" in out["error"]["message"]
            assert "z" not in await _models(env)
    run(main())


def test_conductor_routes_by_adapter_and_prefix(model_dir, tokenizer):
    """P0 holds the prompt's blocks under the base model, P1 the same tokens under adapter ``ad`` (vLLM's KV
    events: lora_name and the name in extra_keys): base requests go to P0, adapter requests to P1."""
    ps = [FakeWorker("P0"), FakeWorker("P1")]
    d = FakeWorker("D")
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    prompt = " ".join(["a", "b", "c", "hello"] * 4)  # 16 tokens = 4 blocks of 4

    async def main():
        for w in ps:
            await w.start()
        ids = tokenizer.encode(prompt, True)
        assert len(ids) == 16
        async with Env(model_dir, tokenizer, ps, [d], policy="conductor", calibrate=False, block_size=4,
                       local_prefill_tokens=0, kv_events_bind=f"tcp://127.0.0.1:{port}", lora_modules=ADAPTERS) as env:
            base = {"type": "BlockStored", "block_hashes": [b"v0", b"v1", b"v2"], "parent_block_hash": None,
                    "token_ids": ids[:12], "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}
            lora = dict(base, block_hashes=[b"l0", b"l1", b"l2"], lora_id=1, lora_name="ad",
                        extra_keys=[["ad"], ["ad"], ["ad"]])
            for seq in range(200):  # ZMQ's slow joiner: publish until the router's subscriber has both
                for w, ev in ((ps[0], base), (ps[1], lora)):
                    pub.send_multipart([w.url.encode(), seq.to_bytes(8, "big"), msgpack.packb([0.0, [ev], None])])
                async with env.session.get(env.url + "/v1/pdserve/workers") as r:
                    body = await r.json()
                if body["indexed_blocks"] >= 6:
                    break
                await asyncio.sleep(0.02)
            assert body["indexed_blocks"] == 6
            for _ in range(3):
                assert (await env.post("/v1/completions", {"model": "ad", "prompt": prompt, "max_tokens": 2}))[0] == 200
            assert len(ps[1].requests) == 3 and ps[0].requests == []  # the adapter's prefix is on P1 only
            for _ in range(3):
                assert (await env.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2}))[0] \
                    == 200
            assert len(ps[0].requests) == 3 and len(ps[1].requests) == 3  # the base model's prefix is on P0 only
            assert all(r["model"] == "ad" for r in ps[1].requests) and all("model" not in r for r in ps[0].requests)

    try:
        run(main())
    finally:
        pub.close(0)
        ctx.term()
