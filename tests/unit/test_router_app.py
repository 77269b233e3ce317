"""Router HTTP behaviour against small fake vLLM workers (aiohttp servers inside the test; no vLLM)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.router.api.tokenizer import PromptTokenizer
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig

VOCAB = ["[UNK]", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "world", "the", "cat", "sat", "on",
         "mat", "a", "b", "c"] + [f"w{i}" for i in range(15, 100)]
EOS = 1
MAX_LEN = 64
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tiny_model(d: Path) -> Path:
    """A word-level tokenizer (whitespace split) with a chat template, and a config.json with a 64-token context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins with spaces
    tok.add_special_tokens(["</s>", "[UNK]"])  # skipped in output text, like a real EOS
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE, "model_max_length": MAX_LEN}))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": MAX_LEN}))
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


class LightTokenizer:
    """The slice of a Hugging Face tokenizer the router uses, built on ``tokenizers`` + jinja2 (importing
    transformers costs ~10 s; the real AutoTokenizer path is covered by the integration test)."""

    def __init__(self, model_dir: Path) -> None:
        import jinja2
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.chat_template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
        self.template = jinja2.Environment().from_string(self.chat_template)

    def __len__(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def backend_tokenizer(self):
        return self.tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, continue_final_message=False,
                            **kw):
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kw)


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> PromptTokenizer:
    return PromptTokenizer(str(model_dir), tokenizer=LightTokenizer(model_dir))


class FakeWorker:
    """A fake vLLM OpenAI server. Its "model": the next token is (last token + 1), wrapping inside 5..99; the
    text of token i is " " + VOCAB[i] unless ``texts`` overrides it. Records every request body.

    Knobs: eos_after (emit EOS as the n-th output token), die_after (drop the connection after n streamed
    tokens), delay_s (between tokens), status (answer every completion with this HTTP error), engine_refusal (an
    error vLLM's engine makes: a 400 unstreamed, 200 and an error event streamed), kv (return
    kv_transfer_params for do_remote_decode requests), healthy.
    """

    def __init__(self, name: str, **kw: Any) -> None:
        self.name = name
        self.requests: list[dict] = []
        self.headers: list[dict] = []  # each request's HTTP headers (a trace's traceparent)
        self.aborted = asyncio.Event()
        self.finished = 0
        self.texts: dict[int, str] = kw.pop("texts", {})
        self.eos_after: int | None = kw.pop("eos_after", None)
        self.die_after: int | None = kw.pop("die_after", None)
        self.delay_s: float = kw.pop("delay_s", 0.0)
        self.status: int | None = kw.pop("status", None)
        self.engine_refusal: bool = kw.pop("engine_refusal", False)
        self.kv: bool = kw.pop("kv", True)
        self.healthy: bool = kw.pop("healthy", True)
        self.prefill_delay_s: float = kw.pop("prefill_delay_s", 0.0)
        self.kv_stats: dict | None = kw.pop("kv_stats", None)  # D reports {"pdserve": {...}} on its last chunk
        assert not kw, kw
        self.runner: web.AppRunner | None = None
        self.url = ""

    def text(self, t: int) -> str:
        return self.texts.get(t, " " + VOCAB[t] if t != EOS else "")

    def generate(self, prompt: list[int], max_tokens: int, stop: list[str], ignore_eos: bool):
        """Yield (token, text delta, finish_reason, stop_reason) like vLLM: text that could begin a stop string is
        held back; a stop string is cut from the output."""
        last, text, sent = prompt[-1], "", 0
        hold = max((len(x) for x in stop), default=1) - 1
        for k in range(max_tokens):
            t = EOS if (self.eos_after is not None and k + 1 == self.eos_after) else (
                5 + (last - 4) % 95 if last >= 5 else 5)
            last = t
            start = max(0, len(text) - hold)
            text += self.text(t)
            hits = [(text.find(x, start), x) for x in stop if text.find(x, start) >= 0]
            if hits:
                at, hit = min(hits)
                yield t, text[sent:at], "stop", hit
                return
            if t == EOS and not ignore_eos:
                yield t, text[sent:], "stop", None
                return
            if k + 1 == max_tokens:
                yield t, text[sent:], "length", None
                return
            upto = max(sent, len(text) - hold)
            yield t, text[sent:upto], None, None
            sent = upto

    def continued(self, body: dict) -> Any:
        """``generate`` for the body: an early D asked to continue after P's first token (``pdserve_continue``, the
        connector's pdserve/vllm/continuation.py) is the serial D: prompt + [t1], one token less."""
        prompt, max_tokens = body["prompt"], body.get("max_tokens", 16)
        kvp = body.get("kv_transfer_params") or {}
        if kvp.get("pdserve_continue") is True and kvp.get("do_remote_prefill"):  # (P's body has the flag too)
            t1 = next(self.generate(prompt, 1, [], True))[0]
            prompt, max_tokens = [*prompt, t1], max_tokens - 1
        return self.generate(prompt, max_tokens, body.get("stop") or [], body.get("ignore_eos", False))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.status is not None:
            return web.json_response({"error": {"message": f"fake error from {self.name}", "type": "BadRequestError",
                                                "param": None, "code": self.status}}, status=self.status)
        if self.engine_refusal:
            err = {"error": {"message": f"engine refusal from {self.name}", "type": "BadRequestError", "param": None,
                             "code": 400}}
            if not body.get("stream"):
                return web.json_response(err, status=400)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        prompt = body["prompt"]
        gen = self.continued(body)
        kvp = None
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            kvp = {"do_remote_prefill": True, "remote_engine_id": self.name, "remote_host": "127.0.0.1",
                   "remote_port": 1, "remote_block_ids": [0], "remote_num_tokens": len(prompt),
                   "remote_request_id": "r-" + self.name} if self.kv else None
        if not body.get("stream"):
            try:
                await asyncio.sleep(self.prefill_delay_s)
            except asyncio.CancelledError:
                self.aborted.set()
                raise
            toks = list(gen)
            self.finished += 1
            return web.json_response({
                "id": "cmpl-fake", "object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": "".join(p for _, p, _, _ in toks), "token_ids": [t for t, *_ in toks],
                             "prompt_token_ids": prompt, "finish_reason": toks[-1][2], "stop_reason": toks[-1][3]}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(toks)},
                "kv_transfer_params": kvp})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = 0
        try:
            for t, piece, finish, stop_reason in gen:
                if self.die_after is not None and n == self.die_after:
                    request.transport.close()  # crash: connection dropped without [DONE]
                    return resp
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                chunk = {"id": "cmpl-fake", "object": "text_completion", "model": "m",
                         "choices": [{"index": 0, "text": piece, "token_ids": [t], "finish_reason": finish,
                                      "stop_reason": stop_reason}]}
                if n == 0:
                    chunk["choices"][0]["prompt_token_ids"] = prompt
                if finish is not None and self.kv_stats is not None:
                    chunk["kv_transfer_params"] = {"pdserve": self.kv_stats}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                n += 1
            usage = {"id": "cmpl-fake", "object": "text_completion", "model": "m", "choices": [],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
            self.finished += 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()
            raise
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def start(self) -> FakeWorker:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class Env:
    """Fake workers + a router on free ports; ``post``/``get`` talk to the router."""

    def __init__(self, model_dir: Path, tokenizer: PromptTokenizer, prefill=(), decode=(), colocated=(), elastic=(),
                 **cfg: Any) -> None:
        self.prefill, self.decode, self.colocated = list(prefill), list(decode), list(colocated)
        self.elastic = list(elastic)
        self.model_dir, self.tokenizer, self.cfg = model_dir, tokenizer, cfg

    async def __aenter__(self) -> Env:
        for w in self._workers():
            if not w.url:
                await w.start()
        config = RouterConfig(model_dir=str(self.model_dir), prefill=tuple(w.url for w in self.prefill),
                              decode=tuple(w.url for w in self.decode),
                              colocated=tuple(w.url for w in self.colocated),
                              elastic=tuple(w.url for w in self.elastic), served_model_name="tiny",
                              port=0, health_interval_s=self.cfg.pop("health_interval_s", 0), **self.cfg)
        self.app = create_app(config, tokenizer=self.tokenizer)
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.session.close()
        await self.runner.cleanup()
        for w in self._workers():
            await w.stop()

    def _workers(self) -> list[FakeWorker]:
        return self.prefill + self.decode + self.colocated + self.elastic

    async def post(self, path: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.session.post(self.url + path, data=data, headers=headers) as r:
            raw = await r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw.decode()

    async def stream(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, list[str]]:
        """Return the status and the raw SSE data payloads (strings), checking the framing."""
        async with self.session.post(self.url + path, json=body, headers=headers) as r:
            raw = (await r.read()).decode()
        if r.status != 200:
            return r.status, [raw]
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = raw.split("\n\n")
        assert events[-1] == "", "stream must end with a blank line"
        payloads = []
        for ev in events[:-1]:
            assert ev.startswith("data: "), ev
            payloads.append(ev[len("data: "):])
        assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
        return r.status, payloads[:-1]

    async def get(self, path: str) -> tuple[int, str]:
        async with self.session.get(self.url + path) as r:
            return r.status, await r.text()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def ids(tok: PromptTokenizer, text: str) -> list[int]:
    return tok.encode(text)


# ---------------------------------------------------------------- the hand-off

def test_pd_non_stream_handoff_sequence(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"model": "tiny", "prompt": "the cat sat", "max_tokens": 4,
                                                         "temperature": 0, "seed": 7, "ignore_eos": True})
            assert st == 200, out
            prompt = ids(tokenizer, "the cat sat")
            assert len(p.requests) == 1 and len(d.requests) == 1
            pb, db = p.requests[0], d.requests[0]
            assert pb["prompt"] == prompt and pb["max_tokens"] == 1 and pb["stream"] is False
            assert pb["kv_transfer_params"] == {"do_remote_decode": True, "lease_on_stop": False}
            assert pb["return_token_ids"] is True
            assert pb["temperature"] == 0 and pb["seed"] == 7 and pb["ignore_eos"] is True
            t1 = 10  # "on" follows "sat" (9) in the fake model
            assert db["prompt"] == prompt + [t1] and db["max_tokens"] == 3 and db["stream"] is True
            assert db["kv_transfer_params"]["remote_engine_id"] == "P"
            assert db["kv_transfer_params"]["remote_num_tokens"] == len(prompt)
            assert db["seed"] == 7 and db["ignore_eos"] is True and db["temperature"] == 0
            assert out["object"] == "text_completion" and out["model"] == "tiny"
            assert out["choices"][0]["text"] == " on mat a b"
            assert out["choices"][0]["finish_reason"] == "length"
            assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
            assert "pdserve_timings" not in out
    run(main())


def test_pd_stream_sse_usage_and_timings(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, chunks = await env.stream("/v1/completions", {
                "prompt": [7, 8], "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}},
                headers={"X-Pdserve-Timings": "1"})
            assert st == 200
            objs = [json.loads(c) for c in chunks]
            text = "".join(o["choices"][0]["text"] for o in objs if o["choices"])
            assert text == " sat on mat a b"
            assert objs[0]["choices"][0]["text"] == " sat"  # t1 from P, streamed first
            finals = [o for o in objs if o["choices"] and o["choices"][0]["finish_reason"]]
            assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
            last = objs[-1]
            assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 2, "completion_tokens": 5,
                                                                "total_tokens": 7}
            tm = last["pdserve_timings"]
            for k in ("queue_ms", "prefill_ms", "handoff_ms", "ttft_ms", "tpot_ms", "decode_ms", "e2e_ms",
                      "router_overhead_ms"):
                assert isinstance(tm[k], float) and tm[k] >= 0, (k, tm)
            assert tm["kv_transfer_bytes"] is None and tm["kv_transfer_ms"] is None
            assert tm["prefill_worker"] == p.url and tm["decode_worker"] == d.url
            assert tm["router_overhead_ms"] <= tm["e2e_ms"]
            st, chunks = await env.stream("/v1/completions", {
                "prompt": [7, 8], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
            objs = [json.loads(c) for c in chunks]
            assert [o["usage"]["completion_tokens"] for o in objs] == [1, 2, 3, 3]
    run(main())


def test_timings_field_non_stream(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3, "pdserve_timings": True})
            assert st == 200 and out["pdserve_timings"]["completion_tokens"] == 3
            assert out["pdserve_timings"]["mode"] == "disaggregated"
            assert "pdserve_timings" not in d.requests[0] and "pdserve_timings" not in p.requests[0]
    run(main())


def test_max_tokens_one_and_eos_skip_decode(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "hello", "max_tokens": 1})
            assert st == 200 and out["choices"][0]["finish_reason"] == "length"
            assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["text"] == " world"
            assert d.requests == []
            p.eos_after = 1
            st, out = await env.post("/v1/completions", {"prompt": "hello", "max_tokens": 8})
            assert st == 200 and out["choices"][0]["finish_reason"] == "stop"
            assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["text"] == ""
            assert d.requests == []
    run(main())


def test_stop_string_across_boundary_aborts_decode(model_dir, tokenizer):
    # t1 = "on" -> " on" from P; D's first token "mat" -> " mat". Stop " on m" spans both.
    p, d = FakeWorker("P"), FakeWorker("D", delay_s=0.02)

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "sat", "max_tokens": 20, "stop": "n m"})
            assert st == 200, out
            c = out["choices"][0]
            assert c["text"] == " o" and c["finish_reason"] == "stop" and c["stop_reason"] == "n m"
            assert out["usage"]["completion_tokens"] == 2
            assert "stop" not in d.requests[0] and "stop" not in p.requests[0]  # the router matches stop strings
            await asyncio.wait_for(d.aborted.wait(), 5)  # router closed D's stream
            # streamed: the held-back " o" comes out, never " on"
            st, chunks = await env.stream("/v1/completions", {"prompt": "sat", "max_tokens": 20, "stop": ["n m"],
                                                              "stream": True})
            objs = [json.loads(x) for x in chunks]
            assert "".join(o["choices"][0]["text"] for o in objs) == " o"
            assert objs[-1]["choices"][0]["finish_reason"] == "stop"
    run(main())


def test_stop_string_inside_decode_and_in_t1(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "sat", "max_tokens": 20, "stop": ["a b"]})
            assert out["choices"][0]["text"] == " on mat " and out["choices"][0]["stop_reason"] == "a b"
            assert out["usage"]["completion_tokens"] == 4
            n_d = len(d.requests)
            st, out = await env.post("/v1/completions", {"prompt": "sat", "max_tokens": 20, "stop": ["n"]})
            assert out["choices"][0]["text"] == " o" and out["choices"][0]["finish_reason"] == "stop"
            assert out["usage"]["completion_tokens"] == 1  # stop in t1: no serial D call (an early D is closed)
            assert all("pdserve_handoff" in (r.get("kv_transfer_params") or {}) for r in d.requests[n_d:])
    run(main())


def test_pd_text_comes_from_router_detokenizer(model_dir, tokenizer):
    # D's own text can be wrong (a prompt ending inside a multi-byte character makes vLLM re-emit prompt text):
    # in P -> D mode the router detokenizes the token ids itself, primed with the prompt like one worker
    p, d = FakeWorker("P", texts={10: "P-TEXT"}), FakeWorker("D", texts={11: "D-TEXT"})

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "sat", "max_tokens": 3})
            assert out["choices"][0]["text"] == " on mat a"
            st, chunks = await env.stream("/v1/completions", {"prompt": "sat", "max_tokens": 3, "stream": True})
            assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == " on mat a"
    run(main())


def test_no_kv_params_decode_recomputes(model_dir, tokenizer):
    p, d = FakeWorker("P", kv=False), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3})
            assert st == 200 and out["choices"][0]["text"] == " b c w15"
            assert "kv_transfer_params" not in d.requests[0]
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_handoffs_total{outcome="no_kv"} 1' in metrics
    run(main())


def test_kv_transfer_stats_reported(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D", kv_stats={"bytes": 1 << 20, "ms": 2.5, "blocks": 1, "ok": True})

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3, "pdserve_timings": True})
            assert out["pdserve_timings"]["kv_transfer_bytes"] == 1 << 20
            assert out["pdserve_timings"]["kv_transfer_ms"] == 2.5
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_phase_seconds_count{mode="disaggregated",phase="kv_transfer"} 1' in metrics
            assert "pdserve_router_kv_transfer_bytes_count 1" in metrics
    run(main())


# ---------------------------------------------------------------- chat

def test_chat_template_applied_and_shapes(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "the cat"}]}]

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 3})
            assert st == 200, out
            want = tokenizer.encode("<|system|> a <|user|> the cat <|assistant|>", add_special_tokens=False)
            assert p.requests[0]["prompt"] == want
            assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
            assert out["choices"][0]["message"] == {"role": "assistant", "content": " hello world the"}
            assert out["usage"]["prompt_tokens"] == len(want) and out["usage"]["completion_tokens"] == 3
            st, chunks = await env.stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "stream": True,
                                                                   "stream_options": {"include_usage": True}})
            objs = [json.loads(c) for c in chunks]
            assert all(o["object"] == "chat.completion.chunk" for o in objs)
            assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"]) == \
                " hello world the"
            assert objs[-1]["usage"]["completion_tokens"] == 3
            # no max_tokens in chat: fills the context
            st, out = await env.post("/v1/chat/completions", {"messages": msgs, "ignore_eos": True})
            assert out["usage"]["completion_tokens"] == MAX_LEN - len(want)
            assert out["choices"][0]["finish_reason"] == "length"
    run(main())


# ---------------------------------------------------------------- errors

def test_max_tokens_over_the_room_left_is_clamped_as_vllm(model_dir, tokenizer):
    """vLLM 0.32 clamps ``max_tokens`` to the room the prompt leaves (``get_max_tokens``), refuses one over
    ``max_model_len`` by name, and checks ``min_tokens`` against the clamped value: the router does the same."""
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": [5] * 60, "max_tokens": 10})
            assert st == 200 and out["usage"]["completion_tokens"] <= MAX_LEN - 60, out
            calls = p.requests + d.requests
            assert [c["max_tokens"] for c in calls] == [1, MAX_LEN - 60 - 1], calls  # P's one token, then D's
            st, out = await env.post("/v1/completions", {"prompt": [5] * 60, "max_tokens": MAX_LEN + 1})
            assert st == 400 and out["error"]["param"] == "max_tokens" and \
                f"cannot be greater than max_model_len={MAX_LEN}" in out["error"]["message"], out
            st, out = await env.post("/v1/completions", {"prompt": [5] * 60, "max_tokens": 10, "min_tokens": 5})
            assert st == 400 and "max_tokens=4, got 5" in out["error"]["message"], out
            assert len(p.requests + d.requests) == 2  # the refusals reached no worker
    run(main())


def _is_openai_error(body: Any) -> bool:
    return (isinstance(body, dict) and set(body) == {"error"}
            and set(body["error"]) == {"message", "type", "param", "code"})


def test_error_statuses_and_shapes(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            cases = [
                (b"{not json", 400, None),
                ({"prompt": "a", "max_tokens": "x"}, 400, "max_tokens"),
                ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
                ({"max_tokens": 2}, 400, "prompt"),
                ({"prompt": "a", "temperature": -1}, 400, "temperature"),
                ({"prompt": "a", "top_p": 0}, 400, "top_p"),
                ({"prompt": "a", "n": 0}, 400, None),  # vLLM's SamplingParams names no parameter
                ({"prompt": "a", "stop": 3}, 400, "stop"),
                ({"prompt": [1, -2]}, 400, "prompt"),
                ({"prompt": [5, 5000]}, 400, None),  # out of the vocabulary: vLLM's engine names no param
                ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
                ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
                ({"prompt": "a", "logprobs": -2}, 400, "logprobs"),
                ([1, 2], 400, None),
                # beam search goes whole to one worker, the values vLLM 0.32's request model crashes on refused
                # first: structured_outputs that is not an object raises AttributeError there (a 500)
                ({"prompt": "a", "use_beam_search": True, "structured_outputs": [None, None]}, 400,
                 "structured_outputs"),
            ]
            for body, status, param in cases:
                st, out = await env.post("/v1/completions", body)
                assert st == status, (body, st, out)
                assert _is_openai_error(out), out
                assert out["error"]["param"] == param, (body, out)
            st, out = await env.post("/v1/completions", {"prompt": [5] * MAX_LEN})
            assert st == 400 and str(MAX_LEN) in out["error"]["message"] and f"{MAX_LEN} tokens" in out["error"]["message"]
            assert out["error"]["code"] == "context_length_exceeded"
            st, out = await env.post("/v1/chat/completions", {"messages": []})
            assert st == 400 and out["error"]["param"] == "messages"
            st, out = await env.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                              "tools": [{"type": "function"}]})
            assert st == 400 and out["error"]["param"] == "tools"
            st, out = await env.get("/v1/nope")
            assert st == 404 and _is_openai_error(json.loads(out))
            assert p.requests == [] and d.requests == []  # nothing reached a worker
            _, metrics = await env.get("/metrics")
            assert 'pdserve_router_requests_total{endpoint="completions",status="400"}' in metrics
            assert 'pdserve_router_requests_total{endpoint="completions",status="404"} 1' in metrics
    run(main())


def test_worker_4xx_passed_through(model_dir, tokenizer):
    p, d = FakeWorker("P", status=400), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a"})
            assert st == 400 and _is_openai_error(out) and "fake error from P" in out["error"]["message"]
            st, out = await env.stream("/v1/completions", {"prompt": "a", "stream": True})
            assert st == 400  # P answered a JSON 400, not an event: before the first token, a real status
            p.status = d.status = 500  # a 5xx moves the request (P, then D alone); with none left: 502
            st, out = await env.post("/v1/completions", {"prompt": "a"})
            assert st == 502 and _is_openai_error(out) and "no other worker" in out["error"]["message"]
    run(main())


def test_engine_refusal_of_a_streamed_request_is_vllms_event(model_dir, tokenizer):
    """P refuses its unstreamed prefill call with a 400 that its engine makes (vLLM: inside the stream of a streamed
    request): the router asks P the body streamed and answers as P does then, 200 and the error event, not a 400;
    an unstreamed request keeps the 400, and D is never asked."""
    p, d = FakeWorker("P", engine_refusal=True), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a"})
            assert st == 400 and "engine refusal from P" in out["error"]["message"]
            st, out = await env.stream("/v1/completions", {"prompt": "a", "stream": True})
            assert st == 200 and len(out) == 1, out
            err = json.loads(out[0])["error"]
            assert err["code"] == 400 and err["type"] == "BadRequestError" and "engine refusal from P" in err["message"]
            probe = p.requests[-1]
            assert probe["stream"] is True and "kv_transfer_params" not in probe  # the probe holds no lease on P
            assert d.requests == []
    run(main())


def test_no_healthy_worker_503(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            await p.stop()  # connection refused from now on
            await d.stop()
            st, out = await env.post("/v1/completions", {"prompt": "a"})
            assert st == 503 and _is_openai_error(out) and out["error"]["code"] == "no_healthy_worker"
            st, out = await env.stream("/v1/completions", {"prompt": "a", "stream": True})
            assert st == 503
            st, body = await env.get("/health")
            assert st == 503 and json.loads(body)["status"] == "unhealthy"
    run(main())


def test_prefill_down_falls_over_to_next(model_dir, tokenizer):
    p1, p2, d = FakeWorker("P1"), FakeWorker("P2"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p1, p2], [d]) as env:
            await p1.stop()
            for _ in range(3):
                st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
                assert st == 200, out
            assert len(p2.requests) == 3
    run(main())


def test_decode_dies_mid_stream_error_event(model_dir, tokenizer):
    p, d = FakeWorker("P", die_after=1), FakeWorker("D", die_after=2)

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], upstream_idle_timeout_s=5, migration_limit=1) as env:
            st, chunks = await asyncio.wait_for(env.stream("/v1/completions", {
                "prompt": "a", "max_tokens": 10, "stream": True}), 10)
            assert st == 200
            objs = [json.loads(c) for c in chunks]
            assert _is_openai_error(objs[-1]) and objs[-1]["error"]["type"] == "server_error"
            assert objs[-1]["error"]["code"] == "migration_limit"
            text = "".join(o["choices"][0]["text"] for o in objs[:-1])
            assert text == " b c w15 w16"  # t1 + D's two tokens, then P's one (it took over, then died too)
            assert p.requests[-1]["prompt"][-3:] == [13, 14, 15] and p.requests[-1]["max_tokens"] == 7
            _, metrics = await env.get("/metrics")
            assert 'status="stream_error"} 1' in metrics
            assert 'pdserve_router_migrations_total{role="decode"} 1.0' in metrics
    run(main())


def test_silent_decode_worker_times_out_with_error_event(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D", delay_s=30)  # accepts, then says nothing

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], upstream_idle_timeout_s=0.3) as env:
            st, chunks = await asyncio.wait_for(env.stream("/v1/completions", {
                "prompt": "a", "max_tokens": 10, "stream": True}), 5)
            assert st == 200
            assert json.loads(chunks[0])["choices"][0]["text"] == " b"  # t1 went out at once
            text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks)
            assert text == " b c w15 w16 w17 w18 w19 w20 w21 w22"  # the silent D's part went to P (local)
            await asyncio.wait_for(d.aborted.wait(), 5)
    run(main())


def test_client_disconnect_aborts_decode(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D", delay_s=0.05)

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            async with env.session.post(env.url + "/v1/completions",
                                        json={"prompt": "a", "max_tokens": 40, "stream": True}) as r:
                assert r.status == 200
                seen = 0
                async for line in r.content:
                    if line.startswith(b"data: "):
                        seen += 1
                    if seen == 3:
                        break
                r.close()  # client hangs up mid-stream
            await asyncio.wait_for(d.aborted.wait(), 5)
            assert d.finished == 0
            # the router stays usable
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
            assert st == 200
    run(main())


def test_client_disconnect_during_prefill_aborts_prefill(model_dir, tokenizer):
    p, d = FakeWorker("P", prefill_delay_s=5.0), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            for stream in (True, False):
                p.aborted.clear()
                task = asyncio.create_task(env.post("/v1/completions", {"prompt": "a", "max_tokens": 4,
                                                                        "stream": stream}))
                while len(p.requests) < (2 if not stream else 1):
                    await asyncio.sleep(0.01)
                task.cancel()  # the client gives up while P is still prefilling
                await asyncio.wait_for(p.aborted.wait(), 3)
            assert d.requests == []
            _, metrics = await env.get("/metrics")
            assert 'status="client_disconnected"} 2' in metrics
    run(main())


# ---------------------------------------------------------------- placement, colocated, health, metrics

def test_round_robin_prefill_and_decode(model_dir, tokenizer):
    ps = [FakeWorker(f"P{i}") for i in range(2)]
    ds = [FakeWorker(f"D{i}") for i in range(3)]

    async def main():
        async with Env(model_dir, tokenizer, ps, ds) as env:
            for _ in range(6):
                st, _ = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
                assert st == 200
            assert [len(w.requests) for w in ps] == [3, 3]
            assert [len(w.requests) for w in ds] == [2, 2, 2]
            # every D got the params of the P that prefilled its request
            assert all(r["kv_transfer_params"]["remote_engine_id"] in ("P0", "P1") for w in ds for r in w.requests)
    run(main())


def test_colocated_mode(model_dir, tokenizer):
    ws = [FakeWorker("W0"), FakeWorker("W1")]

    async def main():
        async with Env(model_dir, tokenizer, colocated=ws) as env:
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3, "pdserve_timings": True})
            assert st == 200 and out["choices"][0]["text"] == " b c w15"
            assert out["pdserve_timings"]["prefill_ms"] is None and out["pdserve_timings"]["mode"] == "colocated"
            st, chunks = await env.stream("/v1/completions", {"prompt": "a", "max_tokens": 3, "stream": True})
            assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == " b c w15"
            assert [len(w.requests) for w in ws] == [1, 1]
            body = ws[0].requests[0]
            assert body["max_tokens"] == 3 and body["stream"] is True and "kv_transfer_params" not in body
            # colocated: the worker sees the whole output, so it gets the stop strings (and holds text back)
            st, out = await env.post("/v1/completions", {"prompt": "a", "max_tokens": 9, "stop": "c w"})
            assert out["choices"][0]["text"] == " b " and out["choices"][0]["stop_reason"] == "c w"
            assert out["usage"]["completion_tokens"] == 3
            assert ws[0].requests[-1]["stop"] == ["c w"]
    run(main())


def test_health_models_metrics(model_dir, tokenizer):
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, body = await env.get("/health")
            assert st == 200 and json.loads(body)["status"] == "ok"
            d.healthy = False
            st, body = await env.get("/health")
            assert st == 503 and any(not w["healthy"] for w in json.loads(body)["workers"])
            d.healthy = True
            assert (await env.get("/health"))[0] == 200  # probing again brings it back
            st, body = await env.get("/v1/models")
            assert st == 200 and json.loads(body)["data"][0]["id"] == "tiny"
            assert json.loads(body)["data"][0]["max_model_len"] == MAX_LEN
            await env.post("/v1/completions", {"prompt": "a", "max_tokens": 3})
            st, text = await env.get("/metrics")
            assert st == 200
            assert 'pdserve_router_requests_total{endpoint="completions",status="200"} 1' in text
            for phase in ("queue", "prefill", "handoff", "ttft", "tpot", "e2e", "router_overhead"):
                assert f'pdserve_router_phase_seconds_count{{mode="disaggregated",phase="{phase}"}} 1' in text
            assert 'pdserve_router_phase_seconds_bucket{le="+Inf",mode="disaggregated",phase="ttft"} 1' in text
            assert "pdserve_router_completion_tokens_total 3" in text
            assert "# TYPE pdserve_router_phase_seconds histogram" in text
    run(main())


def test_background_health_marks_worker_down_and_up(model_dir, tokenizer):
    p1, p2, d = FakeWorker("P1"), FakeWorker("P2"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p1, p2], [d], health_interval_s=0.05) as env:
            p1.healthy = False
            await asyncio.sleep(0.3)
            for _ in range(4):
                assert (await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2}))[0] == 200
            assert len(p1.requests) == 0 and len(p2.requests) == 4
            p1.healthy = True
            await asyncio.sleep(0.3)
            for _ in range(2):
                await env.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
            assert len(p1.requests) == 1
    run(main())


# ---------------------------------------------------------------- observability (issue 40)

def test_decision_record_and_prediction_error_of_a_pd_request(model_dir, tokenizer):
    """A placed request's decision record (GET /v1/pdserve/decisions/{id}: the pair, the rule, predicted and
    measured TTFT/TPOT) and its prediction error on /metrics; an unknown id is an OpenAI-style 404."""
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"prompt": "the cat sat", "max_tokens": 4,
                                                         "temperature": 0, "ignore_eos": True})
            assert st == 200, out
            st, text = await env.get(f"/v1/pdserve/decisions/{out['id']}")
            assert st == 200, text
            rec = json.loads(text)
            assert rec["request_id"] == out["id"] and rec["policy"] == "round_robin"  # the router's default
            (placed,) = rec["placements"]
            assert placed["kind"] == "disaggregated" and placed["why"] == "first"
            assert (placed["prefill"], placed["decode"]) == (p.url, d.url) and placed["rule"]
            assert placed["predicted"]["ttft_s"] > 0 and placed["predicted"]["tpot_s"] > 0
            assert placed["measured"]["ttft_s"] > 0 and placed["measured"]["tpot_s"] > 0
            st, text = await env.get("/v1/pdserve/decisions/cmpl-unknown")
            err = json.loads(text)["error"]
            assert st == 404 and err["code"] == "decision_not_found" and err["param"] == "request_id"
            st, metrics = await env.get("/metrics")
            assert f'pdserve_router_ttft_prediction_error_ratio_count{{policy="round_robin",worker="{p.url}"}} 1.0' \
                in metrics
            assert f'pdserve_router_tpot_prediction_error_ratio_count{{policy="round_robin",worker="{d.url}"}} 1.0' \
                in metrics

    run(main())
