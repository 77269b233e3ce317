"""Router + conductor against fake workers: membership API, 429 + Retry-After, prefix routing fed by real ZMQ
KV events, decode-local, per-worker load metrics."""

from __future__ import annotations

import asyncio
import json

import msgpack
import zmq

from pdserve.launch.procs import free_port
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

PATH = "/v1/pdserve/workers"


async def _delete(env: Env, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with env.session.delete(env.url + PATH, json=body, headers=headers) as r:
        return r.status, await r.json()


async def _get(env: Env, headers: dict | None = None) -> tuple[int, dict]:
    async with env.session.get(env.url + PATH, headers=headers) as r:
        return r.status, await r.json()


def test_membership_add_remove(model_dir, tokenizer):
    p, d1, d2 = FakeWorker("P"), FakeWorker("D1"), FakeWorker("D2")

    async def main():
        await d2.start()
        async with Env(model_dir, tokenizer, [p], [d1]) as env:
            st, body = await _get(env)
            assert st == 200 and [w["url"] for w in body["workers"]] == [p.url, d1.url]
            st, out = await env.post(PATH, {"url": d2.url, "role": "decode"})
            assert st == 201 and out["roles"] == ["decode"]
            for _ in range(4):
                assert (await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2}))[0] == 200
            assert len(d1.requests) == 2 and len(d2.requests) == 2
            st, _ = await _delete(env, {"url": d1.url})
            assert st == 200
            for _ in range(2):
                assert (await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2}))[0] == 200
            assert len(d1.requests) == 2 and len(d2.requests) == 4  # a removed worker gets nothing new
            st, out = await _delete(env, {"url": d1.url})
            assert st == 404 and "is registered" in out["error"]["message"]
            st, out = await env.post(PATH, {"url": d1.url, "role": "colocated"})
            assert st == 400 and out["error"]["param"] == "role"
            st, out = await env.post(PATH, {"url": "ftp://x", "role": "decode"})
            assert st == 400 and out["error"]["param"] == "url"
            st, _ = await _delete(env, {"url": d2.url})
            n = len(p.requests)
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
            assert st == 200 and len(p.requests) == n + 1  # no decode worker: P serves it whole
            assert "kv_transfer_params" not in p.requests[-1]
            st, body = await env.get("/ready")
            assert st == 200 and json.loads(body) == {"status": "degraded", "mode": "disaggregated",
                                                      "healthy_workers": 1, "workers": 1, "missing": ["decode"]}
    run(main())


def test_membership_needs_token_when_set(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], admin_token="s3cret") as env:
            st, out = await _get(env)
            assert st == 401 and out["error"]["type"] == "authentication_error"
            st, _ = await _get(env, {"Authorization": "Bearer s3cret"})
            assert st == 200
    run(main())


def test_router_starts_empty_and_workers_join(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        await p.start()
        await d.start()
        async with Env(model_dir, tokenizer, mode_hint="disaggregated") as env:
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
            assert st == 503
            await env.post(PATH, {"url": p.url, "role": "prefill"})
            await env.post(PATH, {"url": d.url, "role": "decode"})
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3})
            assert st == 200 and out["choices"][0]["text"] == " b c w15"
        await p.stop()
        await d.stop()
    run(main())


def test_unattainable_ttft_gets_429_with_retry_after(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], policy="conductor", calibrate=False, ttft_slo_ms=1.0,
                       local_prefill_tokens=0) as env:
            async with env.session.post(env.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 2}) as r:
                body = await r.json()
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "rate_limit_error" and "TTFT" in body["error"]["message"]
            assert p.requests == [] and d.requests == []
            _, metrics = await env.get("/metrics")
            assert 'pdserve_conductor_decisions_total{kind="reject"} 1' in metrics
            assert 'pdserve_router_requests_total{endpoint="completions",status="429"} 1' in metrics
    run(main())


def test_decode_local_for_short_prompts(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], policy="conductor", calibrate=False,
                       local_prefill_tokens=8) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3, "pdserve_timings": True})
            assert st == 200 and out["choices"][0]["text"] == " b c w15"
            assert p.requests == [] and len(d.requests) == 1 and "kv_transfer_params" not in d.requests[0]
            assert out["pdserve_timings"]["prefill_worker"] is None
            st, out = await env.post("/v1/completions", {"prompt": " ".join(["a"] * 20), "max_tokens": 2})
            assert st == 200 and len(p.requests) == 1  # 20 uncached tokens > 8: disaggregated
            _, metrics = await env.get("/metrics")
            assert 'pdserve_conductor_decisions_total{kind="local"} 1' in metrics
            assert f'pdserve_worker_queued_prefill_tokens{{role="prefill",worker="{p.url}"}} 0' in metrics
            assert f'pdserve_worker_running_requests{{role="decode",worker="{d.url}"}} 0' in metrics
    run(main())


def test_prefix_routing_from_real_kv_events(model_dir, tokenizer):
    ps = [FakeWorker("P0"), FakeWorker("P1")]
    d = FakeWorker("D")
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)  # like vLLM's publisher: connects to the router's sink, topic = worker URL
    pub.connect(f"tcp://127.0.0.1:{port}")
    prompt = " ".join(["a", "b", "c", "hello"] * 4)  # 16 tokens = 4 blocks of 4

    async def main():
        for w in ps:
            await w.start()
        ids = tokenizer.encode(prompt, True)
        assert len(ids) == 16
        async with Env(model_dir, tokenizer, ps, [d], policy="conductor", calibrate=False, block_size=4,
                       local_prefill_tokens=0, kv_events_bind=f"tcp://127.0.0.1:{port}") as env:
            topic = ps[1].url.encode()
            event = {"type": "BlockStored", "block_hashes": [b"v0", b"v1", b"v2"], "parent_block_hash": None,
                     "token_ids": ids[:12], "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}
            for seq in range(200):  # ZMQ's slow joiner: publish until the router's subscriber has it
                pub.send_multipart([topic, seq.to_bytes(8, "big"), msgpack.packb([0.0, [event], None])])
                _, body = await _get(env)
                if body["indexed_blocks"] >= 3:
                    break
                await asyncio.sleep(0.02)
            assert body["indexed_blocks"] == 3
            for _ in range(3):
                st, _ = await env.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
                assert st == 200
            assert len(ps[1].requests) == 3 and ps[0].requests == []  # every time to the holder of the prefix
            _, metrics = await env.get("/metrics")
            assert f'pdserve_conductor_indexed_blocks{{holder="{ps[1].url}"}} 3' in metrics
            # worker restarted: AllBlocksCleared empties its entries
            pub.send_multipart([topic, (999).to_bytes(8, "big"), msgpack.packb([0.0, [{"type": "AllBlocksCleared"}]])])
            for _ in range(100):
                _, body = await _get(env)
                if body["indexed_blocks"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert body["indexed_blocks"] == 0

    try:
        run(main())
    finally:
        pub.close(0)
        ctx.term()


def test_ready_needs_one_healthy_worker_per_role(model_dir, tokenizer):
    p, d1, d2 = FakeWorker("P"), FakeWorker("D1"), FakeWorker("D2")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d1, d2]) as env:
            st, body = await env.get("/ready")
            assert st == 200 and json.loads(body)["status"] == "ready"
            d1.healthy = False
            await env.get("/health")  # a probe marks D1 down: /health fails, /ready still serves
            assert (await env.get("/ready"))[0] == 200
            p.healthy = False
            await env.get("/health")
            st, body = await env.get("/ready")  # D2 alone can still serve whole requests
            assert st == 200 and json.loads(body)["status"] == "degraded" and json.loads(body)["missing"] == ["prefill"]
            d2.healthy = False
            await env.get("/health")
            st, body = await env.get("/ready")
            assert st == 503 and json.loads(body)["status"] == "not ready"
        async with Env(model_dir, tokenizer, mode_hint="disaggregated") as env:
            st, body = await env.get("/ready")
            assert st == 503 and json.loads(body)["missing"] == ["prefill", "decode"]
    run(main())


def test_load_probe_reads_vllm_metrics():
    from pdserve.router.fleet.load_probe import parse_vllm_metrics

    text = "\n".join([
        "# HELP vllm:num_requests_waiting Number of requests waiting.",
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="4096"} 1.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
    ])
    r = parse_vllm_metrics(text)
    assert (r.waiting, r.running, r.kv_usage, r.kv_capacity_tokens) == (3, 2, 0.25, 4096 * 128)
    assert (r.prefix_cache_queries, r.prefix_cache_hits) == (1000.0, 640.0)
    assert parse_vllm_metrics("garbage line\n") == parse_vllm_metrics("")
