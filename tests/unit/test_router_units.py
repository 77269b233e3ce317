"""Router pieces without HTTP: config validation, request parsing, stop strings, SSE parsing, placement, metrics."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from pdserve.conductor import ConductorConfig
from pdserve.router.__main__ import config_from_args
from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.config import RouterConfig, RouterConfigError
from pdserve.router.errors import RouterError, from_worker
from pdserve.router.fleet.placement import ConductorPlacement, make_placement
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.metrics import RouterMetrics
from pdserve.router.run.generation import StopStrings, Timings
from pdserve.router.workers.client import Wait, WorkerClient, WorkerError, _sse_data


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return str(tmp_path)


# ---- config

def test_config_modes_and_defaults(model_dir):
    c = RouterConfig(model_dir=model_dir, prefill=("http://127.0.0.1:1/",), decode=("http://127.0.0.1:2",))
    assert c.mode == "disaggregated" and c.prefill == ("http://127.0.0.1:1",) and c.max_model_len == 4096
    assert c.served_model_name == model_dir and c.host == "127.0.0.1"
    c = RouterConfig(model_dir=model_dir, colocated=("http://h:1",), max_model_len=2048, served_model_name="m")
    assert c.mode == "colocated" and c.max_model_len == 2048 and c.all_workers() == [("colocated", "http://h:1")]


@pytest.mark.parametrize("kwargs,needle", [
    ({}, "--prefill"),
    ({"prefill": ("http://a:1",)}, "--decode"),
    ({"colocated": ("http://a:1",), "prefill": ("http://a:2",)}, "cannot be combined"),
    ({"colocated": ("a:1",)}, "base URL"),
    ({"colocated": ("http://a:1/v1",)}, "without a path"),
    ({"colocated": ("http://a:1",), "port": 70000}, "--port"),
    ({"colocated": ("http://a:1",), "upstream_idle_timeout_s": 0}, "--upstream-idle-timeout-s"),
])
def test_config_errors_say_how_to_fix(model_dir, kwargs, needle):
    with pytest.raises(RouterConfigError, match=needle):
        RouterConfig(model_dir=model_dir, **kwargs)


def test_config_model_dir_checks(tmp_path):
    with pytest.raises(RouterConfigError, match="not a directory"):
        RouterConfig(model_dir=str(tmp_path / "nope"), colocated=("http://a:1",))
    with pytest.raises(RouterConfigError, match="no tokenizer files"):
        RouterConfig(model_dir=str(tmp_path), colocated=("http://a:1",))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(RouterConfigError, match="--max-model-len"):
        RouterConfig(model_dir=str(tmp_path), colocated=("http://a:1",))


def test_cli_flags(model_dir):
    c = config_from_args(["--model-dir", model_dir, "--prefill", "http://a:1", "http://a:2", "--prefill",
                          "http://a:3", "--decode", "http://b:1", "--port", "0", "--served-model-name", "m",
                          "--max-model-len", "2048"])
    assert c.prefill == ("http://a:1", "http://a:2", "http://a:3") and c.decode == ("http://b:1",)
    assert c.port == 0 and c.served_model_name == "m" and c.max_model_len == 2048


# ---- request parsing

def test_parse_completion_fields():
    r = parse_completion({"prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                          "stop": "x", "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}, "unknown_field": 1})
    assert r.prompt_text == "hi" and r.max_tokens == 5 and r.stop == ["x"] and r.stream and r.include_usage
    assert r.sampling == {"temperature": 0.5, "top_p": 0.9, "seed": 3, "ignore_eos": True}
    assert parse_completion({"prompt": [1, 2]}).prompt_ids == [1, 2]
    assert parse_completion({"prompt": [[1, 2]]}).prompt_ids == [1, 2]
    assert parse_completion({"prompt": "x"}).max_tokens == 16
    assert parse_completion({"prompt": "x", "max_tokens": None}).max_tokens == 16  # vLLM 0.32's default


@pytest.mark.parametrize("body,param", [
    ({"prompt": ["a", ""]}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1.5]}, "prompt"),
    ({"prompt": "a", "seed": "1"}, "seed"), ({"prompt": "a", "stream": "maybe"}, "stream"),
    ({"prompt": "a", "temperature": float("nan")}, "temperature"), ({"prompt": "a", "echo": 2}, "echo"),
    ({"prompt": "a", "presence_penalty": 2.5}, None), ({"prompt": "a", "stop": [1]}, "stop"),  # vLLM: unnamed
])
def test_parse_completion_rejects(body, param):
    with pytest.raises(RouterError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


def test_parse_chat():
    r = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 7})
    assert r.messages == [{"role": "user", "content": "a\nb"}] and r.max_tokens == 7 and r.add_generation_prompt
    assert parse_chat({"messages": [{"role": "user", "content": "a"}]}).max_tokens is None
    for bad in ({"messages": "x"}, {"messages": [{"content": "a"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}):
        with pytest.raises(RouterError):
            parse_chat(bad)


def test_worker_errors_map_to_openai_shape():
    e = from_worker(400, {"error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}})
    assert e.status == 400 and e.to_dict() == {"error": {"message": "too long", "type": "BadRequestError",
                                                         "param": None, "code": 400}}
    e = from_worker(500, None)
    assert e.status == 502 and e.type == "server_error"


# ---- stop strings

def test_stop_strings_hold_back_and_cut():
    s = StopStrings(["abc"], include=False)
    assert s.feed("xa") == ("", None)  # the last len("abc")-1 characters are held back (as vLLM does)
    assert s.feed("b") == ("x", None)
    assert s.feed("cde") == ("", "abc")
    s = StopStrings(["abc"], include=False)
    assert s.feed("xab") == ("x", None) and s.feed("z") == ("a", None) and s.flush() == "bz"
    s = StopStrings(["b", "abc"], include=True)
    assert s.feed("xab") == ("xab", "b")
    s = StopStrings([], include=False)
    assert s.feed("anything") == ("anything", None)


# ---- SSE parsing

def test_sse_data_lines():
    assert _sse_data(b"data: {\"a\": 1}") == b'{"a": 1}'
    assert _sse_data(b": keep-alive") is None
    assert _sse_data(b"event: x\r\ndata: [DONE]") == b"[DONE]"


def test_stream_parser_handles_tiny_tcp_pieces_and_errors():
    events = [{"choices": [{"text": "é" * 3, "token_ids": [1]}]}, {"choices": [{"text": "x", "token_ids": [2]}]}]
    payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    async def handler(request):
        mode = request.query.get("mode", "ok")
        resp = web.StreamResponse()
        await resp.prepare(request)
        if mode == "error":
            await resp.write(b'data: {"error": {"message": "boom", "type": "x", "param": null, "code": 500}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        body = payload if mode == "ok" else payload[: len(payload) // 2]
        for i in range(0, len(body), 3):  # 3-byte writes split events, lines and UTF-8 characters
            await resp.write(body[i:i + 3])
            await asyncio.sleep(0)
        return resp

    # the mode travels in the query string; a tiny client subclass adds it
    class Q(WorkerClient):
        mode = "ok"

        async def _post(self, url, path, body, headers=None):
            return await super()._post(url, path + "?mode=" + self.mode, body, headers)

    async def main2():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as session:
                client = Q(session, 2.0, 2.0)
                assert [e async for e in client.stream(url, {}, Wait())] == events
                client.mode = "cut"
                with pytest.raises(WorkerError) as e:
                    _ = [x async for x in client.stream(url, {}, Wait())]
                assert e.value.kind == "closed"
                client.mode = "error"
                with pytest.raises(WorkerError) as e:
                    _ = [x async for x in client.stream(url, {}, Wait())]
                assert e.value.kind == "stream_error" and "boom" in str(e.value)
                with pytest.raises(WorkerError) as e:
                    _ = [x async for x in client.stream("http://127.0.0.1:1", {}, Wait())]
                assert e.value.kind == "connect"
        finally:
            await runner.cleanup()

    asyncio.run(main2())


def round_robin(prefill: list[str], decode: list[str], colocated: tuple[str, ...] = ()) -> ConductorPlacement:
    """The router's placement with the ``round_robin`` policy over these worker URLs."""
    registry = WorkerRegistry([("prefill", u) for u in prefill] + [("decode", u) for u in decode]
                              + [("colocated", u) for u in colocated])
    return make_placement(registry, ConductorConfig(policy="round_robin"), 0)


# ---- placement

def test_round_robin_skips_unhealthy_and_excluded():
    rr = round_robin(["http://p0", "http://p1"], ["http://d0", "http://d1", "http://d2"])
    picks = [rr.choose([1]) for _ in range(6)]
    assert [c.prefill.url for c in picks] == ["http://p0", "http://p1"] * 3
    assert [c.decode.url for c in picks] == ["http://d0", "http://d1", "http://d2"] * 2
    rr.registry.set_health("http://p0", False, "probe failed")  # the registry tells the conductor at once
    assert {rr.choose([1]).prefill.url for _ in range(4)} == {"http://p1"}
    t = rr.choose([1], frozenset({"http://p1"}))  # no prefill worker left: a decode worker serves it whole
    assert t.prefill is None and t.decode.url.startswith("http://d") and "degraded" in t.decision.reason
    t.close()
    with pytest.raises(RouterError) as e:
        rr.choose([1], frozenset({"http://p1", "http://d0", "http://d1", "http://d2"}))
    assert e.value.status == 503 and "no healthy worker" in e.value.message
    co = round_robin([], [], ("http://c0", "http://c1"))
    assert [co.choose([1]).decode.url for _ in range(3)] == ["http://c0", "http://c1", "http://c0"]
    assert co.choose([1]).prefill is None


# ---- metrics / timings

def test_timings_report_and_metrics_text():
    t = Timings(arrive=0.0)
    t.dispatch, t.p_sent, t.p_done, t.d_sent, t.d_first, t.d_end = 0.001, 0.001, 0.101, 0.102, 0.150, 0.350
    t.first_token, t.last_token, t.end, t.tokens = 0.101, 0.350, 0.351, 6
    t.wait.seconds = 0.340
    r = t.report()
    assert r["queue_ms"] == 1.0 and r["prefill_ms"] == 100.0 and r["handoff_ms"] == pytest.approx(49.0)
    assert r["ttft_ms"] == 101.0 and r["tpot_ms"] == pytest.approx(49.8) and r["e2e_ms"] == 351.0
    assert r["router_overhead_ms"] == pytest.approx(11.0)
    m = RouterMetrics()
    m.observe_timings("disaggregated", r)
    text = m.render()
    assert 'pdserve_router_phase_seconds_bucket{le="0.15",mode="disaggregated",phase="ttft"} 1' in text
    assert 'pdserve_router_phase_seconds_bucket{le="0.1",mode="disaggregated",phase="ttft"} 0' in text
    assert 'pdserve_router_phase_seconds_count{mode="disaggregated",phase="prefill"} 1' in text
    assert 'phase="kv_transfer"' not in text  # None: not observed
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2
