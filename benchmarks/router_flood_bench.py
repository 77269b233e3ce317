"""The router's memory under a flood: N concurrent streamed completions at once against a real router process in
front of one fake prefill and one fake decode worker (a small real aiohttp server in its own process that answers
like vLLM: P one token + kv_transfer_params, D a token stream with a delay per token). It measures the router, not
vLLM.

Two runs in one go: the router with every request admitted (``--max-inflight`` above N: the baseline), and with
``--max-inflight LIMIT`` (the rest answered 429 + Retry-After before their body is read). For each: the router's
RSS idle, at its peak during the flood and after the drain (sampled from /proc every 20 ms), requests completed,
answered 429, failed, and wall time. A table, then a final JSON line; ``ratio`` is the limited run's peak RSS growth
over the baseline's.

    python benchmarks/router_flood_bench.py [--requests 1000] [--limit 256] [--tokens 32] [--token-delay-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

VOCAB = ["[UNK]", "</s>"] + [f"w{i}" for i in range(2, 200)]


# ---------------------------------------------------------------- the fake worker (own process)

def fake_worker(port: int, token_delay_s: float) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        n = int(body.get("max_tokens", 16))
        if not body.get("stream"):
            return web.json_response({"id": "p", "object": "text_completion", "choices": [{
                "index": 0, "text": " w5", "token_ids": [5], "finish_reason": "length"}],
                "kv_transfer_params": {"do_remote_prefill": True, "remote_num_tokens": len(prompt)}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(token_delay_s)
            t = 6 + i % 150
            chunk = {"id": "d", "object": "text_completion", "choices": [{
                "index": 0, "text": f" w{t}", "token_ids": [t], "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


# ---------------------------------------------------------------- the bench

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_model(d: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["</s>", "[UNK]"])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "[UNK]",
        "model_max_length": 4096}))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                                               "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64}))
    return d


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def wait_http(url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


async def flood(url: str, n: int, tokens: int) -> dict[str, int]:
    import aiohttp

    out = {"completed": 0, "rejected_429": 0, "failed": 0}
    body = {"prompt": " ".join(f"w{2 + i % 100}" for i in range(64)), "max_tokens": tokens, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one() -> None:
            try:
                async with s.post(url + "/v1/completions", json=body) as r:
                    raw = await r.read()
                    if r.status == 429 and "Retry-After" in r.headers:
                        out["rejected_429"] += 1
                    elif r.status == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw:
                        out["completed"] += 1
                    else:
                        out["failed"] += 1
            except aiohttp.ClientError:
                out["failed"] += 1
        await asyncio.gather(*(one() for _ in range(n)))
    return out


def run_once(model: Path, workers: list[str], n: int, tokens: int, limit: int) -> dict:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    router = subprocess.Popen([sys.executable, "-m", "pdserve.router", "--model-dir", str(model), "--prefill",
                               workers[0], "--decode", workers[1], "--port", str(port), "--max-inflight", str(limit),
                               "--max-inflight-per-worker", str(max(limit, n)), "--log-level", "error",
                               "--health-interval-s", "1"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", 120)
        time.sleep(0.5)
        idle = rss_kib(router.pid)
        peak = [idle]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_kib(router.pid))
                time.sleep(0.02)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t0 = time.perf_counter()
        counts = asyncio.run(flood(url, n, tokens))
        wall = time.perf_counter() - t0
        stop.set()
        th.join()
        time.sleep(1.0)
        after = rss_kib(router.pid)
        return {"max_inflight": limit, **counts, "rss_idle_mib": round(idle / 1024, 1),
                "rss_peak_mib": round(peak[0] / 1024, 1), "rss_after_mib": round(after / 1024, 1),
                "rss_growth_mib": round((peak[0] - idle) / 1024, 1), "wall_s": round(wall, 2)}
    finally:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=256, help="--max-inflight of the limited run")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    ap.add_argument("--token-delay-ms", type=float, default=20.0, help="fake decode worker's time per token")
    ap.add_argument("--fake-worker", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.fake_worker:
        fake_worker(a.fake_worker, a.token_delay_ms / 1000.0)
        return 0
    ports = [free_port(), free_port()]
    fakes = [subprocess.Popen([sys.executable, __file__, "--fake-worker", str(p), "--token-delay-ms",
                               str(a.token_delay_ms)]) for p in ports]
    workers = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for w in workers:
            wait_http(w + "/health", 60)
        with tempfile.TemporaryDirectory() as tmp:
            model = write_model(Path(tmp) / "model")
            rows = [run_once(model, workers, a.requests, a.tokens, a.requests + 1),
                    run_once(model, workers, a.requests, a.tokens, a.limit)]
    finally:
        for f in fakes:
            f.terminate()
            f.wait(10)
    cols = ["max_inflight", "completed", "rejected_429", "failed", "rss_idle_mib", "rss_peak_mib", "rss_after_mib",
            "rss_growth_mib", "wall_s"]
    print(f"router RSS under {a.requests} concurrent streamed requests ({a.tokens} tokens, "
          f"{a.token_delay_ms:g} ms/token from a fake decode worker)")
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]!s:>14}" for c in cols))
    base, lim = rows
    ratio = round(lim["rss_growth_mib"] / base["rss_growth_mib"], 3) if base["rss_growth_mib"] > 0 else None
    print(json.dumps({"bench": "router_flood", "requests": a.requests, "baseline": base, "limited": lim,
                      "ratio": ratio, "ratio_means": "limited run's peak RSS growth / baseline's"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
