"""The live view's JSON (GET /v1/pdserve/fleet) and page (GET /dashboard), and the X-Pdserve-Decision header, on
fake workers (the page itself runs in a real Chromium in tests/integration/test_dashboard_browser.py)."""

from __future__ import annotations

import asyncio
import json

from pdserve.router.endpoints.dashboard import mean_ratio
from pdserve.router.endpoints.decision_header import DECISION_HEADER
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401  (fixtures)

BODY = {"prompt": "the cat sat", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_the_fleet_json_holds_workers_counters_and_the_newest_records(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            ids = []
            for _ in range(2):
                st, out = await env.post("/v1/completions", BODY)
                assert st == 200, out
                ids.append(out["id"])
            st, text = await env.get("/v1/pdserve/fleet")
            assert st == 200, text
            view = json.loads(text)
            rows = {w["url"]: w for w in view["workers"]}
            assert set(rows) == {p.url, d.url} and all(w["healthy"] for w in rows.values())
            assert rows[p.url]["roles"] == ["prefill"] and rows[d.url]["roles"] == ["decode"]
            assert rows[p.url]["ttft_error_ratio"] > 0 and rows[d.url]["tpot_error_ratio"] > 0
            assert rows[d.url]["kv_usage"] is not None and rows[d.url]["returns"] == 0
            assert rows[p.url]["doing"] == rows[d.url]["doing"] == "idle"  # both requests are done
            assert view["counters"]["placements"]["disaggregated"] == 2 and view["counters"]["requests"] == 2
            assert view["last_minute"] == {"placed disaggregated": 2}
            assert [r["request_id"] for r in view["recent"]] == ids[::-1]  # newest first
            assert view["recent"][0]["placements"][0]["prefill"] == p.url
            st, page = await env.get("/dashboard")
            assert st == 200 and "<title>pdserve fleet</title>" in page and "/v1/pdserve/fleet" in page

    run(main())


def test_mean_ratio_per_worker():
    m = {"x_sum": [({"worker": "a", "policy": "p"}, 3.0), ({"worker": "b", "policy": "p"}, 1.0)],
         "x_count": [({"worker": "a", "policy": "p"}, 2.0), ({"worker": "b", "policy": "p"}, 0.0)]}
    assert mean_ratio(m, "x") == {"a": 1.5}


def test_the_decision_header_on_request(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            async with env.session.post(env.url + "/v1/completions", json=BODY,
                                        headers={DECISION_HEADER: "1"}) as r:
                assert r.status == 200
                rec = json.loads(r.headers[DECISION_HEADER])
                rid = (await r.json())["id"]
            (placed,) = rec["placements"]
            assert rec["request_id"] == rid and placed["why"] == "first" and "open" not in placed
            assert (placed["prefill"], placed["decode"]) == (p.url, d.url) and placed["measured"]["ttft_s"] > 0
            st, text = await env.get(f"/v1/pdserve/decisions/{rid}")
            assert json.loads(text) == rec  # the JSON answer's header is the whole record
            async with env.session.post(env.url + "/v1/completions", json={**BODY, "stream": True},
                                        headers={DECISION_HEADER: "1"}) as r:
                streamed = json.loads(r.headers[DECISION_HEADER])
                await r.read()
            (placed,) = streamed["placements"]
            assert placed["open"] is True and "measured" not in placed and placed["decode"] == d.url
            async with env.session.post(env.url + "/v1/completions", json=BODY) as r:
                assert DECISION_HEADER not in r.headers  # only on request
                await r.read()
            async with env.session.post(env.url + "/v1/completions", json={**BODY, "n": 2, "temperature": 1},
                                        headers={DECISION_HEADER: "true"}) as r:
                both = json.loads(r.headers[DECISION_HEADER])
                await r.read()
            assert [c["request_id"] for c in both["choices"]] == [f"{both['request_id']}-0", f"{both['request_id']}-1"]

    run(main())


def test_restarts_seen_count_a_worker_back_after_being_out_not_its_first_start(model_dir, tokenizer):
    p, d = FakeWorker("P", healthy=False), FakeWorker("D")  # P not up yet when the router starts

    async def returns(env: Env) -> dict[str, tuple[bool, int]]:
        st, text = await env.get("/v1/pdserve/fleet")
        return {w["url"]: (w["healthy"], w["returns"]) for w in json.loads(text)["workers"]}

    async def until(env: Env, want: dict) -> None:
        for _ in range(100):
            if await returns(env) == want:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(await returns(env))

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], health_interval_s=0.05) as env:
            await until(env, {p.url: (False, 0), d.url: (True, 0)})
            p.healthy = True  # its first start: not a restart
            await until(env, {p.url: (True, 0), d.url: (True, 0)})
            d.healthy = False
            await until(env, {p.url: (True, 0), d.url: (False, 0)})
            d.healthy = True  # back: one restart seen
            await until(env, {p.url: (True, 0), d.url: (True, 1)})

    run(main())
