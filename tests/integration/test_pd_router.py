"""The whole disaggregated path as a client sees it: `pdserve` cluster (1P1D with the connector, router in
front), checked against the decode worker serving the same request alone, and a client that leaves mid-stream.
The same stack serves the OpenAI API tests of issue 15 (logprobs, n, prompt lists, tokenize, structured
outputs, tools), so they cost no vLLM start of their own."""

from __future__ import annotations

import importlib.util
import json
import random
import time
import urllib.error
import urllib.request

import pytest

from pdserve.bench.prom import scrape
from pdserve.launch import Cluster

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
]  # shares pd_cluster (tests/conftest.py: SHARED_STACKS)
openai = pytest.importorskip("openai")

NEAR_GREEDY = 1e-5  # vLLM's least temperature that samples (n > 1 allowed): the greedy answer in practice


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _alone(cluster: Cluster, path: str, body: dict) -> dict:
    """The same request served start to finish by the decode worker alone (no kv_transfer_params)."""
    return _post(cluster.worker_urls("decode")[0] + path, body)


def _metric(url: str, name: str) -> float:
    return scrape(url, name).get(name, 0.0)


def _settled_metric(url: str, name: str, quiet_s: float = 1.0) -> float:
    """A counter once it stopped moving for ``quiet_s`` (vLLM counts a request's tokens as its engine's outputs are
    processed, which may be after the answer, or, for a request stopped by a stop string, for a few steps after)."""
    last, since = _metric(url, name), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.2)
        now = _metric(url, name)
        if now != last:
            last, since = now, time.monotonic()
    return last


LEASE_S = 30.0  # the connector's default lease (a P lease no decode read is freed by then)


def _wait_for_empty_caches(cluster: Cluster) -> None:
    """Before a test that checks both workers free every block: wait out what earlier tests on this stack left
    leased on P (a request that ended with P's answer, or whose client left before D was asked, holds P's blocks
    until its lease ends, as a vLLM P holds them for a D that never reads), at most one lease."""
    urls = [cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]]
    deadline = time.monotonic() + LEASE_S + 5
    while any(_metric(u, "vllm:kv_cache_usage_perc") for u in urls) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [_metric(u, "vllm:kv_cache_usage_perc") for u in urls] == [0.0, 0.0], "blocks held past a lease"


@pytest.mark.parametrize("length", [100, 1000])
def test_router_pd_output_equals_one_worker(cluster, length):
    ids = [random.Random(length).randrange(1000, 40000) for _ in range(length)]
    body = {"model": "rl", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reads_before = _metric(cluster.worker_urls("decode")[0], "vllm:pdserve_kv_reads_total")
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
    kw = {k: v for k, v in body.items() if k != "ignore_eos"}
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True,
                                                                            extra_body={"ignore_eos": True})
                       if c.choices)
    reference = _alone(cluster, "/v1/completions", body)["choices"][0]["text"]
    assert plain.choices[0].text == streamed == reference
    assert plain.usage.prompt_tokens == length and plain.usage.completion_tokens == 16
    assert _metric(cluster.worker_urls("decode")[0], "vllm:pdserve_kv_reads_total") >= reads_before + 2


@pytest.fixture(scope="module")
def always_router(cluster, tmp_path_factory):
    """A second router over the cluster's P and D with ``--early-continue always``: D continues after P's first token
    whatever the sampling (the cluster's router, ``auto``, regenerates a greedy t1 from this layer-wise P)."""
    import sys

    from pdserve.launch.plan import router_env
    from pdserve.launch.procs import free_port, spawn_healthy, stop_children

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = cluster.config
    child = spawn_healthy("router-always", [
        sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(port), "--model-dir", cfg.model,
        "--served-model-name", "rl", "--max-model-len", str(cfg.max_model_len), "--tool-call-parser", "hermes",
        "--prefill", cluster.worker_urls("prefill")[0], "--decode", cluster.worker_urls("decode")[0],
        "--early-continue", "always"], url, timeout_s=120, env=router_env(),
        log_path=tmp_path_factory.mktemp("router-always") / "router.log")
    try:
        yield url
    finally:
        stop_children([child])


def _handoffs(router: str) -> dict[str, float]:
    return scrape(router, "pdserve_router_handoffs_total", labels=True)


def _grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


@pytest.mark.parametrize("continue_mode", ["always", "auto"])
def test_early_dispatch_equals_one_worker_continuing_or_regenerating(cluster, always_router, continue_mode):
    """Early dispatch (issue 37): prompts that share a prefix, each sent to D while P prefills it; D waits for P's
    blocks and reads the ones its prefix cache lacks. ``always``: D continues after P's first token (P's answer
    carries it); ``auto`` (the default): this P sends layer by layer (host memory), so a greedy request's D
    regenerates t1 (the router checks it equals P's) and a sampled one (n > 1, near-greedy) continues. Greedy fp32
    output equals the decode worker's alone, token for token: with max_tokens 2, repetition_penalty, min_tokens,
    logprobs, n > 1 (near-greedy), and a stop string spanning P's token and D's first. No D gave way to the serial
    hand-off; D generated max_tokens - 1 tokens per continued choice and max_tokens per regenerated one."""
    router = always_router if continue_mode == "always" else cluster.router_url
    rng = random.Random(37)
    prefix = [rng.randrange(1000, 40000) for _ in range(600)]
    base = {"model": "rl", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    extras = [{}, {"max_tokens": 2}, {"repetition_penalty": 1.3}, {"min_tokens": 6, "ignore_eos": False},
              {"logprobs": 2}, {"n": 2, "temperature": NEAR_GREEDY}, {}]
    bodies = [{**base, "prompt": prefix + [rng.randrange(1000, 40000) for _ in range(n)], **x}
              for n, x in zip((5, 130, 260, 131, 7, 64, 300), extras)]
    d_url = cluster.worker_urls("decode")[0]
    refs = [_alone(cluster, "/v1/completions", b) for b in bodies]
    # a stop string across P's token and D's first (one worker's text of the first two tokens, cut inside both)
    two = _alone(cluster, "/v1/completions", {**bodies[-1], "max_tokens": 2})["choices"][0]
    one = _alone(cluster, "/v1/completions", {**bodies[-1], "max_tokens": 1})["choices"][0]["text"]
    stop = one[-2:] + two["text"][len(one):][:2]
    assert len(one) >= 1 and len(two["text"]) > len(one), (one, two)
    stopped = {**bodies[-1], "stop": [stop], "max_tokens": 16}
    stop_ref = _alone(cluster, "/v1/completions", stopped)["choices"][0]
    _post(router + "/v1/completions", {**base, "prompt": prefix[:40]})  # P is known
    before = _handoffs(router)
    generated = _settled_metric(d_url, "vllm:generation_tokens_total")
    for body, ref in zip(bodies, refs):
        out = _post(router + "/v1/completions", body)
        for mine, theirs in zip(out["choices"], ref["choices"], strict=True):
            assert (mine["text"], mine["token_ids"], mine["finish_reason"]) == \
                (theirs["text"], theirs["token_ids"], theirs["finish_reason"]), body
            if "logprobs" in body:
                assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
                assert [round(x, 4) for x in mine["logprobs"]["token_logprobs"]] == \
                    [round(x, 4) for x in theirs["logprobs"]["token_logprobs"]]
        assert out["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    choices = sum(b.get("n", 1) for b in bodies)
    d_generated = _settled_metric(d_url, "vllm:generation_tokens_total") - generated
    regenerates = continue_mode == "auto"
    assert d_generated == sum(b.get("n", 1) * (len(r["choices"][0]["token_ids"]) - 1 + (
        regenerates and b["temperature"] == 0)) for b, r in zip(bodies, refs))
    out = _post(router + "/v1/completions", stopped)["choices"][0]
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == \
        (stop_ref["text"], stop_ref["finish_reason"], stop_ref["stop_reason"])
    assert stop_ref["finish_reason"] == "stop" and len(stop_ref["text"]) < len(one)  # it began inside P's token
    grew = _grew(before, _handoffs(router))
    assert grew == {'pdserve_router_handoffs_total{outcome="early"}': float(choices + 1)}, grew


def test_early_dispatch_moves_a_long_prompt_layer_by_layer(cluster):
    """Layer-wise KV (issue 37 item 2, on by default): a prompt D has not seen is read layer by layer, and layers
    landed on D (verified) while P's forward that computed them was still running (P answered D's next question with
    its forward not done); a long prompt makes P's last forward long enough to see it. Exact against D alone."""
    rng = random.Random(38)
    prefix = [rng.randrange(1000, 40000) for _ in range(600)]
    base = {"model": "rl", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    d_url = cluster.worker_urls("decode")[0]
    _post(cluster.router_url + "/v1/completions", {**base, "prompt": prefix[:40]})  # P is known
    layered = {k: _metric(d_url, f"vllm:pdserve_kv_{k}_total") for k in ("layerwise_reads", "layers_early")}
    long_body = {**base, "prompt": prefix + [rng.randrange(1000, 40000) for _ in range(1300)]}
    out = _post(cluster.router_url + "/v1/completions", long_body)
    assert out["choices"][0]["text"] == _alone(cluster, "/v1/completions", long_body)["choices"][0]["text"]
    now = {k: _metric(d_url, f"vllm:pdserve_kv_{k}_total") for k in ("layerwise_reads", "layers_early")}
    assert now["layerwise_reads"] - layered["layerwise_reads"] == 1, (layered, now)
    assert now["layers_early"] > layered["layers_early"], (layered, now)


def test_router_pd_chat_equals_one_worker(cluster):
    body = {"model": "rl", "messages": [{"role": "user", "content": "Name three colours, please."}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                         extra_body={"ignore_eos": True})
    reference = _alone(cluster, "/v1/chat/completions", body)
    assert out.choices[0].message.content == reference["choices"][0]["message"]["content"]
    assert out.usage.prompt_tokens == reference["usage"]["prompt_tokens"]


def test_launch_pool_saves_pd_prompts_and_p_frees_after(cluster):
    """The launch's own KV pool: P saves a P -> D prompt's blocks and frees them once D read them and the save
    ended (tests/integration/pool_launch.py)."""
    from tests.integration.pool_launch import check_launch_pool_saves_pd_prompts

    check_launch_pool_saves_pd_prompts(cluster)


def test_pd_streams_are_relayed_as_bytes_and_equal_one_worker(cluster):
    """D's stream goes through the byte relay once its text settles; text and ids equal one worker's."""
    from tests.integration.pd_relay import check_pd_streams_are_relayed_and_exact

    check_pd_streams_are_relayed_and_exact(cluster.router_url, cluster.worker_urls("decode")[0])


def test_client_leaving_mid_stream_frees_blocks_on_both_workers(cluster):
    p_url, d_url = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    _wait_for_empty_caches(cluster)
    released = _metric(p_url, "vllm:pdserve_kv_released_notified_total")
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
    ids = [random.Random(7).randrange(1000, 40000) for _ in range(600)]
    stream = client.completions.create(model="rl", prompt=ids, max_tokens=1400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 5:
            break
    stream.close()
    deadline = time.monotonic() + 20  # well inside P's 30 s lease: freeing must come from the hand-off
    def usage() -> tuple[float, float]:
        return _metric(p_url, "vllm:kv_cache_usage_perc"), _metric(d_url, "vllm:kv_cache_usage_perc")

    while usage() != (0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.2)
    if usage() != (0.0, 0.0):
        tail = "".join((cluster.run_dir / f"{w}.log").read_text()[-3000:] for w in ("prefill0", "decode0"))
        raise AssertionError(f"KV blocks still held after the client left: {usage()}\n{tail}")
    assert _metric(d_url, "vllm:num_requests_running") == 0
    assert _metric(p_url, "vllm:pdserve_kv_released_notified_total") == released + 1
    assert json.loads(urllib.request.urlopen(cluster.router_url + "/health", timeout=10).read())["status"] == "ok"


# ---- The OpenAI API through the disaggregated path (issue 15): logprobs (+ echo, prompt_logprobs), n > 1, prompt
# lists, /tokenize and /detokenize, structured outputs and tools, each against the same request on one worker.

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "the time in a zone", "strict": True,
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["answer", "n"], "additionalProperties": False}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _api_alone(cluster: Cluster, path: str, body: dict) -> dict:
    """The same request served start to finish by the decode worker alone (no kv_transfer_params)."""
    return _post(cluster.worker_urls("decode")[0] + path, {"model": "rl", **body})


def _close(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert abs(x - y) < 1e-3, (a, b)


def _same_completion_logprobs(mine: dict, ref: dict) -> None:
    assert mine["tokens"] == ref["tokens"]
    assert mine["text_offset"] == ref["text_offset"]
    _close(mine["token_logprobs"], ref["token_logprobs"])
    for m, r in zip(mine["top_logprobs"], ref["top_logprobs"]):
        assert (m is None) == (r is None)
        if m is not None:
            assert list(m) == list(r)
            _close(list(m.values()), list(r.values()))


def _same_chat_logprobs(mine: list[dict], ref: list[dict]) -> None:
    assert [e["token"] for e in mine] == [e["token"] for e in ref]
    assert [e["bytes"] for e in mine] == [e["bytes"] for e in ref]
    _close([e["logprob"] for e in mine], [e["logprob"] for e in ref])
    for m, r in zip(mine, ref):
        assert [t["token"] for t in m["top_logprobs"]] == [t["token"] for t in r["top_logprobs"]]
        _close([t["logprob"] for t in m["top_logprobs"]], [t["logprob"] for t in r["top_logprobs"]])


def _stream_completion(client, **kw) -> tuple[dict[int, str], dict[int, dict]]:
    texts: dict[int, str] = {}
    lps: dict[int, dict] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                acc = lps.setdefault(c.index, {"tokens": [], "text_offset": [], "token_logprobs": [],
                                               "top_logprobs": []})
                for k in acc:
                    acc[k] += getattr(c.logprobs, k)
    return texts, lps


def test_completion_logprobs_and_echo_equal_one_worker(cluster, client):
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    ref = _api_alone(cluster, "/v1/completions", {**body, "ignore_eos": True})["choices"][0]
    out = client.completions.create(model="rl", **body, extra_body={"ignore_eos": True}).model_dump()
    assert out["choices"][0]["text"] == ref["text"]
    _same_completion_logprobs(out["choices"][0]["logprobs"], ref["logprobs"])
    texts, lps = _stream_completion(client, model="rl", **body, extra_body={"ignore_eos": True})
    assert texts[0] == ref["text"]
    _same_completion_logprobs(lps[0], ref["logprobs"])
    # echo: the prompt's tokens first, their logprobs from P's prompt_logprobs
    ref = _api_alone(cluster, "/v1/completions", {**body, "echo": True, "ignore_eos": True})["choices"][0]
    out = client.completions.create(model="rl", **body, echo=True, extra_body={"ignore_eos": True}).model_dump()
    assert out["choices"][0]["text"] == ref["text"] and ref["text"].startswith(body["prompt"])
    _same_completion_logprobs(out["choices"][0]["logprobs"], ref["logprobs"])
    texts, lps = _stream_completion(client, model="rl", **body, echo=True, extra_body={"ignore_eos": True})
    assert texts[0] == ref["text"]
    _same_completion_logprobs(lps[0], ref["logprobs"])
    # vLLM's prompt_logprobs, as the worker returns them
    ref = _api_alone(cluster, "/v1/completions", {**body, "prompt_logprobs": 1, "ignore_eos": True})["choices"][0]
    out = client.completions.create(model="rl", **body, extra_body={"prompt_logprobs": 1, "ignore_eos": True})
    mine = out.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(mine) == len(ref["prompt_logprobs"]) and mine[0] is None
    for m, r in zip(mine[1:], ref["prompt_logprobs"][1:]):
        assert list(m) == list(r)
        _close([v["logprob"] for v in m.values()], [v["logprob"] for v in r.values()])


def test_chat_logprobs_equal_one_worker(cluster, client):
    body = {"messages": USER, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    ref = _api_alone(cluster, "/v1/chat/completions", {**body, "ignore_eos": True})["choices"][0]
    out = client.chat.completions.create(model="rl", **body, extra_body={"ignore_eos": True}).model_dump()
    assert out["choices"][0]["message"]["content"] == ref["message"]["content"]
    _same_chat_logprobs(out["choices"][0]["logprobs"]["content"], ref["logprobs"]["content"])
    content, entries = "", []
    for chunk in client.chat.completions.create(model="rl", stream=True, **body, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            content += c.delta.content or ""
            if c.logprobs is not None:
                entries += c.logprobs.model_dump()["content"]
    assert content == ref["message"]["content"]
    _same_chat_logprobs(entries, ref["logprobs"]["content"])


def test_n_and_prompt_lists_equal_one_worker(cluster, client):
    # near-greedy (temperature 1e-5, vLLM's least random sampling: the router refuses greedy n > 1 as vLLM does):
    # every choice is one worker's greedy n=1 output
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    ref = _api_alone(cluster, "/v1/completions", {**body, "ignore_eos": True})
    body["temperature"] = NEAR_GREEDY
    out = client.completions.create(model="rl", **body, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [ref["choices"][0]["text"]] * 3
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref["usage"]["prompt_tokens"], 18)
    texts, _ = _stream_completion(client, model="rl", **body, n=3, extra_body={"ignore_eos": True})
    assert [texts[i] for i in range(3)] == [ref["choices"][0]["text"]] * 3
    # a list of prompts with n=2: choices in order prompt by prompt, usage summed (prompts counted once)
    body = {"prompt": ["Once upon a time", "In a hole in the ground"], "max_tokens": 5, "temperature": 0}
    ref = _api_alone(cluster, "/v1/completions", {**body, "ignore_eos": True})
    body["temperature"] = NEAR_GREEDY
    out = client.completions.create(model="rl", **body, n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [c["text"] for c in ref["choices"] for _ in range(2)]
    assert out.usage.prompt_tokens == ref["usage"]["prompt_tokens"]
    assert out.usage.completion_tokens == 20
    # sampling with a seed: choice i is seeded seed + i as vLLM seeds its n children, so its first token (P's)
    # is the one worker's; D samples the rest with a fresh generator (see the README)
    seeded = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.0, "seed": 7, "n": 2}
    ref = _api_alone(cluster, "/v1/completions", {**seeded, "return_token_ids": True, "ignore_eos": True})
    out = client.completions.create(model="rl", **seeded, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.model_dump()["token_ids"][0] for c in out.choices] == [c["token_ids"][0] for c in ref["choices"]]
    # chat n=2, streamed: each choice carries its index
    chat = {"messages": USER, "max_tokens": 5, "temperature": 0}
    ref = _api_alone(cluster, "/v1/chat/completions", {**chat, "ignore_eos": True})
    chat["temperature"] = NEAR_GREEDY
    got: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="rl", stream=True, n=2, **chat,
                                                extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
    assert [got[0], got[1]] == [ref["choices"][0]["message"]["content"]] * 2


def test_tokenize_and_detokenize_as_vllm(cluster):
    for body in ({"prompt": "Hello world, again", "return_token_strs": True},
                 {"messages": USER, "tools": TOOLS}, {"messages": USER, "add_generation_prompt": False}):
        mine = _post(cluster.router_url + "/tokenize", {"model": "rl", **body})
        assert mine == _api_alone(cluster, "/tokenize", body)
        back = {"tokens": mine["tokens"]}
        assert _post(cluster.router_url + "/detokenize", back) == _api_alone(cluster, "/detokenize", back)


def _chat_both(cluster, client, body: dict) -> tuple[dict, dict, str, list]:
    """(router's answer, one worker's answer, router's streamed content, streamed tool-call deltas)."""
    ref = _api_alone(cluster, "/v1/chat/completions", body)
    out = client.chat.completions.create(model="rl", **body).model_dump()
    content, calls = "", []
    for chunk in client.chat.completions.create(model="rl", stream=True, **body):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += [t.model_dump() for t in c.delta.tool_calls or []]
    return out, ref, content, calls


def test_structured_outputs_equal_one_worker(cluster, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out, ref, streamed, _ = _chat_both(cluster, client, {"messages": USER, "max_tokens": 40, "temperature": 0,
                                                         "response_format": fmt})
    text = out["choices"][0]["message"]["content"]
    assert text == ref["choices"][0]["message"]["content"] == streamed
    assert out["choices"][0]["finish_reason"] == "stop" and set(json.loads(text)) == {"answer", "n"}
    for so in ({"choice": ["red", "green", "blue"]}, {"regex": "[a-c]{3}-[0-9]{2}"}):
        body = {"prompt": "Pick:", "max_tokens": 12, "temperature": 0, "structured_outputs": so}
        ref = _api_alone(cluster, "/v1/completions", body)["choices"][0]["text"]
        got = client.completions.create(model="rl", prompt="Pick:", max_tokens=12, temperature=0,
                                        extra_body={"structured_outputs": so}).choices[0].text
        assert got == ref
        if "choice" in so:
            assert got in so["choice"]


def _args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _streamed_calls(deltas: list[dict]) -> list[tuple[str, dict]]:
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
        fn = d.get("function") or {}
        c["name"] += fn.get("name") or ""
        c["arguments"] += fn.get("arguments") or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_tool_calls_equal_one_worker(cluster, client, choice):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": 48, "temperature": 0}
    out, ref, streamed, deltas = _chat_both(cluster, client, body)
    mine, theirs = out["choices"][0], ref["choices"][0]
    assert _args(mine["message"].get("tool_calls") or []) == _args(theirs["message"].get("tool_calls") or [])
    assert mine["message"]["content"] == theirs["message"]["content"]
    assert mine["finish_reason"] == theirs["finish_reason"]
    if choice != "auto":  # constrained: valid JSON arguments even from random weights
        calls = _args(mine["message"]["tool_calls"])
        assert calls and all(set(args) == {"city"} or set(args) == {"zone"} for _, args in calls)
        if isinstance(choice, dict):
            assert {name for name, _ in calls} == {"get_time"}
        assert _streamed_calls(deltas) == calls
    else:
        assert streamed == (theirs["message"]["content"] or "")


def test_messages_and_responses_apis_equal_one_worker(cluster):
    """/v1/messages and /v1/responses through P and D, whole and streamed (with a tool call), equal one worker's
    own endpoints (body in tests/integration/api_shapes.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.api_shapes import check_errors, check_messages, check_responses

    router, worker = cluster.router_url, cluster.worker_urls("decode")[0]
    with ThreadPoolExecutor(3) as pool:  # the three APIs' cases side by side, as three clients would send them
        tool_blocks = pool.submit(check_messages, router, worker)
        responses, errors = pool.submit(check_responses, router, worker), pool.submit(check_errors, router, worker)
        assert tool_blocks.result() >= 1, "the named tool case made no tool_use block"
        responses.result()
        errors.result()


def test_unsupported_fields_are_400(client):
    for kw in ({"suffix": "x"}, {"extra_body": {"guided_json": {"type": "object"}}},
               {"extra_body": {"structured_outputs": {"json": {}, "regex": "a"}}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="rl", prompt="a", max_tokens=2, **kw)
        assert e.value.status_code == 400


def test_beam_search_runs_whole_on_one_worker_as_vllm(cluster, client):
    """use_beam_search: the whole request on one worker, its beams as D's own answer (greedy beams are
    deterministic), and vLLM's refusal of a streamed completions beam search as vLLM words it."""
    body = {"model": "rl", "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "n": 3,
            "use_beam_search": True, "return_token_ids": True}
    mine, ref = _post(cluster.router_url + "/v1/completions", body), _api_alone(cluster, "/v1/completions", body)
    beams = [c["token_ids"] for c in mine["choices"]]
    assert len(beams) == 3 and len({tuple(b) for b in beams}) == 3, beams  # three distinct beams
    assert beams == [c["token_ids"] for c in ref["choices"]] and mine["usage"] == ref["usage"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="rl", prompt="a", max_tokens=2, stream=True,
                                  extra_body={"use_beam_search": True})
    assert e.value.status_code == 400 and "beam search" in str(e.value)
    chat = {"model": "rl", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6,
            "temperature": 0, "n": 2, "use_beam_search": True}
    mine, ref = _post(cluster.router_url + "/v1/chat/completions", chat), _api_alone(cluster, "/v1/chat/completions",
                                                                                      chat)
    assert len(mine["choices"]) == 2 and mine["choices"][0]["message"]["content"]
    assert [c["message"] for c in mine["choices"]] == [c["message"] for c in ref["choices"]]
    events = [c for c in client.chat.completions.create(**{k: v for k, v in chat.items() if k != "use_beam_search"},
                                                         stream=True, extra_body={"use_beam_search": True})]
    text = {i: "".join(ch.delta.content or "" for ev in events for ch in ev.choices if ch.index == i) for i in (0, 1)}
    assert text == {i: c["message"]["content"] for i, c in enumerate(ref["choices"])}  # vLLM's stream of the beams


def _one_token_word(cluster, text: str) -> str:
    """A word of ``text`` that is one token with and without its leading space, so vLLM bans it in both forms."""
    def n(t: str) -> int:
        return len(_post(cluster.router_url + "/tokenize", {"model": "rl", "prompt": t,
                                                              "add_special_tokens": False})["tokens"])
    return next(w for w in text.split() if n(w) == 1 and n(" " + w) == 1)


def _forwarded_cases(cluster, plain: dict) -> list[dict]:
    """One body per field of api/fields.py that the workers read (forwarded or regenerated), with values that act
    on a random model's greedy output: penalties against its repeats, a bias against its first token, a mask, one
    of its words as a bad word."""
    return [{"presence_penalty": 2.0, "frequency_penalty": 2.0}, {"frequency_penalty": 2.0},
            {"logit_bias": {str(plain["token_ids"][0]): -100.0}}, {"allowed_token_ids": list(range(3000, 3040))},
            {"bad_words": [_one_token_word(cluster, plain["text"])]}, {"cache_salt": "tenant-a"}, {"priority": 0},
            {"logprobs": 1, "return_tokens_as_token_ids": True}, {"stream_interval": 3},
            {"min_tokens": 8, "stop_token_ids": [plain["token_ids"][2]]},
            {"presence_penalty": 0.8, "cache_salt": "tenant-b", "logit_bias": {"1500": 5.0}}]


def test_forwarded_fields_equal_one_worker(cluster):
    """Every field the router forwards acts as on one worker: text, token ids and finish (streamed and not). The
    cases run 4 at a time (fp32: batching does not change greedy output), as a client's requests would."""
    from concurrent.futures import ThreadPoolExecutor

    ids = [random.Random(7).randrange(1000, 40000) for _ in range(120)]
    base = {"model": "rl", "prompt": ids, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    plain = _alone(cluster, "/v1/completions", base)["choices"][0]
    with ThreadPoolExecutor(4) as pool:
        acted = [a for a in pool.map(lambda extra: _forwarded_case(cluster, base, plain, extra),
                                     _forwarded_cases(cluster, plain)) if a is not None]
    assert all(a for _, a in acted), f"cases that do not act on this model prove nothing: {acted}"


def _forwarded_case(cluster, base: dict, plain: dict, extra: dict) -> tuple[dict, bool] | None:
    """One case of the test above: the router's answer, whole and streamed, equals D's alone; (the case, whether
    the field changed the output), None for the fields that are not meant to change it."""
    body = {**base, **extra}
    ref = _alone(cluster, "/v1/completions", body)["choices"][0]
    acted = None
    if not {"cache_salt", "priority", "return_tokens_as_token_ids", "stream_interval"} & set(extra):
        without = {k: v for k, v in body.items() if k != "min_tokens"}  # min_tokens acts against the stop
        baseline = plain if "min_tokens" not in extra else _alone(cluster, "/v1/completions", without)["choices"][0]
        acted = (extra, ref["text"] != baseline["text"])
    mine = _post(cluster.router_url + "/v1/completions", body)["choices"][0]
    assert (mine["text"], mine["token_ids"], mine["finish_reason"]) == \
        (ref["text"], ref["token_ids"], ref["finish_reason"]), extra
    if "logprobs" in extra:
        assert mine["logprobs"]["tokens"] == ref["logprobs"]["tokens"], extra
        assert all(t.startswith("token_id:") for t in mine["logprobs"]["tokens"])
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = {k: v for k, v in body.items() if k in ("model", "prompt", "max_tokens", "temperature")}
    rest = {k: v for k, v in body.items() if k not in kw}
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True, extra_body=rest)
                       if c.choices)
    assert streamed == ref["text"], extra
    return acted


def test_request_id_names_the_answer_as_vllm(cluster):
    body = {"model": "rl", "prompt": "a b c", "max_tokens": 2, "temperature": 0, "request_id": "client-42"}
    assert _post(cluster.router_url + "/v1/completions", body)["id"] == "cmpl-client-42"


def test_client_leaving_n_stream_frees_blocks(cluster, client):
    p_url, d_url = cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]
    _wait_for_empty_caches(cluster)
    stream = client.completions.create(model="rl", prompt="Tell me a very long story " * 30, max_tokens=1500, n=2,
                                       temperature=NEAR_GREEDY, stream=True, logprobs=1, extra_body={"ignore_eos": True})
    seen: dict[int, int] = {}
    for chunk in stream:  # leave once both choices are decoding on D (see the report on P-answered-D-not-asked)
        for c in chunk.choices:
            seen[c.index] = seen.get(c.index, 0) + 1
        if len(seen) == 2 and min(seen.values()) >= 3:
            break
    stream.close()
    deadline = time.monotonic() + 20

    def usage() -> tuple[float, float]:
        return (scrape(p_url, "vllm:kv_cache_usage_perc").get("vllm:kv_cache_usage_perc", 0.0),
                scrape(d_url, "vllm:kv_cache_usage_perc").get("vllm:kv_cache_usage_perc", 0.0))

    while usage() != (0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.2)
    if usage() != (0.0, 0.0):
        tail = "".join((cluster.run_dir / f"{w}.log").read_text()[-3000:] for w in ("prefill0", "decode0"))
        raise AssertionError(f"KV blocks still held after the client left: {usage()}\n{tail}")
    try:
        health = json.loads(urllib.request.urlopen(cluster.router_url + "/health", timeout=10).read())
    except urllib.error.HTTPError as e:
        health = json.loads(e.read())
    assert health["status"] == "ok"


def test_elastic_router_over_the_same_workers_equals_one_worker(cluster, tmp_path):
    """Elastic roles (issue 16) on this stack's two kv_both workers: a second router started with ``--elastic``
    places each request colocated on one worker or split P -> D over both (the conductor's choice); a mixed batch
    equals one worker's output. `pdserve serve --elastic 2` itself (the launcher's plan) is in
    tests/integration/test_elastic_vllm.py (slow tier) and tests/unit/test_launcher_elastic.py."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.elastic_moves import elastic_router

    urls = [cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]]
    with elastic_router(str(cluster.model_dir), urls, tmp_path / "elastic-router.log") as router:
        def body(length: int, seed: int) -> dict:
            rng = random.Random(seed)
            return {"model": "rl", "prompt": [rng.randrange(1000, 40000) for _ in range(length)], "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True}

        first = [body(1000, 1), body(40, 2)]  # idle pool: the long prompt is split, the short one colocated
        batch = [body(n, 10 + i) for i, n in enumerate((1000, 60, 900, 30))]
        routed = [_post(router + "/v1/completions", b) for b in first]
        with ThreadPoolExecutor(len(batch)) as pool:
            routed += list(pool.map(lambda b: _post(router + "/v1/completions", b), batch))
        for b, out in zip(first + batch, routed):
            assert out["choices"][0]["text"] == _alone(cluster, "/v1/completions", b)["choices"][0]["text"]
            assert out["usage"]["completion_tokens"] == 8
        got = scrape(router, "pdserve_conductor_decisions_total", labels=True)
        kinds = {k: sum(v for key, v in got.items() if f'kind="{k}"' in key) for k in ("local", "disaggregated")}
        assert kinds["disaggregated"] >= 1 and kinds["local"] >= 1, kinds


def test_elastic_router_moves_a_running_decode_off_a_long_prefill(cluster, tmp_path):
    """Issue 16: a decode running on one of this stack's kv_both workers moves to the other when a long prefill
    lands on its worker; the KV moves through the connector and the output equals one worker's
    (tests/integration/elastic_moves.py)."""
    from tests.integration.elastic_moves import run_move_case

    run_move_case(str(cluster.model_dir), [cluster.worker_urls("prefill")[0], cluster.worker_urls("decode")[0]],
                  tmp_path, [cluster.run_dir / "prefill0.log", cluster.run_dir / "decode0.log"])
