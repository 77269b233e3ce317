"""Two router apps as replicas sharing a membership file (fake workers, a fake vLLM publisher on real pyzmq
sockets): a worker added with its KV event publisher through one replica reaches the other, both subscribe and
index its blocks; a bad endpoint is a 400; each replica names itself in ``X-Pdserve-Replica``."""

from __future__ import annotations

import asyncio
import json
import os

from tests.unit.test_kv_event_feed import BS, FakePublisher, _stored
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

PATH = "/v1/pdserve/workers"


def test_a_worker_added_through_one_replica_is_indexed_by_both(model_dir, tokenizer, tmp_path):
    p0, d0, late = FakeWorker("P0"), FakeWorker("D0"), FakeWorker("P1")

    async def main() -> None:
        await late.start()
        pub = FakePublisher(topic=late.url)
        shared = dict(policy="conductor", calibrate=False, local_prefill_tokens=0, block_size=BS, routers=2,
                      membership_file=str(tmp_path / "membership.json"))
        try:
            async with Env(model_dir, tokenizer, prefill=[p0], decode=[d0], **shared) as a, \
                    Env(model_dir, tokenizer, prefill=[p0], decode=[d0], **shared) as b:
                st, out = await a.post(PATH, {"url": late.url, "role": "prefill", "kv_events": "udp://x"})
                assert st == 400 and out["error"]["param"] == "kv_events"
                st, _ = await a.post(PATH, {"url": late.url, "role": "prefill", "kv_events": pub.publisher.endpoint,
                                            "kv_replay": pub.publisher.replay})
                assert st == 201
                await asyncio.sleep(1.5)  # b polls the file every 0.5 s; both replay from the publisher
                parent = None
                for i in range(0, 6, 2):
                    pub.publish(_stored(i, parent))
                    parent = i
                for _ in range(100):
                    views = []
                    for env in (a, b):
                        st, body = await env.get(PATH)
                        views.append({w["url"]: w.get("indexed_blocks") for w in json.loads(body)["workers"]})
                    if all(v.get(late.url) == 3 for v in views):
                        break
                    await asyncio.sleep(0.05)
                assert views[0] == views[1] and views[0][late.url] == 3
                async with a.session.get(a.url + PATH) as r:
                    assert r.headers["X-Pdserve-Replica"] == str(os.getpid())
                    assert (await r.json())["replica"] == {"pid": os.getpid(), "routers": 2}
        finally:
            pub.close()
            await late.stop()

    run(main())
