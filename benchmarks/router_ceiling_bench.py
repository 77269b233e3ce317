"""How many streamed tokens one router process can carry: tokens per router CPU-second and tokens/s delivered, for
P -> D and colocated streams, with 1 and 2 router processes, against a baseline router in the same run.

    python benchmarks/router_ceiling_bench.py [--streams 16 64 256] [--colocated-streams 256] [--routers 1 2]
                                              [--tokens 400] [--token-ms 5] [--stream-interval 1] [--window-s 8]
                                              [--repeat 3] [--baseline-root DIR] [--quick]
                                              [--worker-json vllm spaced]

The workers are fakes (each its own process) that answer like vLLM 0.32 and cost next to nothing: a raw asyncio
HTTP/1.1 server whose prefill answers one token and ``kv_transfer_params``, and whose streams are vLLM's compact
events, one per token (the first with ``prompt_token_ids``, then the finish, usage and ``[DONE]``), ``--tokens``
per request, a token every ``--token-ms`` from one shared ticker (``--stream-interval N``: as vLLM's flag, the
first token at once, then an event per N tokens). So what is measured is the router: the clients (a raw
asyncio client in this process, closed loop, each stream followed at once by the next) keep ``S`` streams open for
``--window-s`` seconds after a warm-up, and the bench reads the tokens delivered in that window and the router
processes' CPU time over it (``/proc/PID/task/*/schedstat``, all threads). With 2 routers, two router processes
front the same fake workers on two ports and the clients alternate between them; the CPU is both processes'.

``--baseline-root DIR`` (another pdserve source tree, e.g. ``git archive REV pdserve | tar -x -C DIR``) runs the
same cases against routers from DIR; the cases take turns (this tree, then the baseline, ``--repeat`` times), so a
busy machine slows both alike, and the table gives medians and the ratio this / baseline of tokens per router
CPU-second. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ["[UNK]", "</s>"] + [f"w{i}" for i in range(2, 200)]


# ----------------------------------------------------------------------------- the fake worker (own process)

_JSON = {"vllm": (",", ":"), "spaced": (", ", ": ")}  # --worker-json: vLLM's compact bytes, or ordinary spacing
_separators = _JSON["vllm"]


def _event(ts: list[int], prompt: list[int] | None, finish: str | None) -> bytes:
    """One streamed completion event carrying tokens ``ts``, in vLLM 0.32's shape (its bytes, or re-spaced)."""
    c = {"index": 0, "text": "".join(f" w{t}" for t in ts), "logprobs": None, "finish_reason": finish,
         "stop_reason": None, "prompt_token_ids": prompt, "token_ids": ts}
    ev = {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000, "model": "m", "choices": [c]}
    return b"data: " + json.dumps(ev, separators=_separators).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Ticker:
    """Every ``period`` s, one event to every open stream (one timer for all of them)."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.streams: list[list[Any]] = []  # [transport, events left (list), index]
        self.loop = asyncio.get_running_loop()
        self.loop.call_later(period, self.tick)

    def tick(self) -> None:
        keep = []
        for s in self.streams:
            tr, events = s[0], s[1]
            if tr.is_closing():
                continue
            if events[s[2]]:
                tr.write(events[s[2]])
            s[2] += 1
            if s[2] < len(events):
                keep.append(s)
        self.streams = keep
        self.loop.call_later(self.period, self.tick)


_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class _WorkerProtocol(asyncio.Protocol):
    def __init__(self, ticker: _Ticker, tokens: int, interval: int) -> None:
        self.ticker, self.tokens, self.interval = ticker, tokens, interval
        self.buf = b""
        self.tr: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.tr = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
            self.handle(head.split(" ", 2), body)

    def handle(self, request_line: list[str], body: bytes) -> None:
        assert self.tr is not None
        if request_line[0] != "POST":
            self.tr.write(_OK)  # /health, /metrics, /ready: the router's probes
            return
        req = json.loads(body)
        prompt = req["prompt"]
        if not req.get("stream"):  # P's prefill: one token, the KV's whereabouts
            out = json.dumps({"id": "cmpl-p", "object": "text_completion", "created": 1700000000, "model": "m",
                              "choices": [{"index": 0, "text": " w5", "logprobs": None, "finish_reason": "length",
                                           "stop_reason": None, "prompt_token_ids": None, "token_ids": [5]}],
                              "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1,
                                        "total_tokens": len(prompt) + 1},
                              "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p",
                                                     "remote_num_tokens": len(prompt)}},
                             separators=(",", ":")).encode()
            self.tr.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                          % (len(out), out))
            return
        n = int(req.get("max_tokens", self.tokens))
        ids = [2 + (prompt[-1] + 1 + k) % 198 for k in range(n)]
        # as vLLM --stream-interval N: the first token at once, then an event per N tokens (a tick per token: the
        # ticks in between write nothing), the finish with whatever is left
        events = [_chunk(_event(ids[:1], prompt, None if n > 1 else "length"))]
        for k in range(1, n, self.interval):
            group = ids[k:k + self.interval]
            last = k + len(group) >= n
            events += [b""] * (len(group) - 1) + [_chunk(_event(group, None, "length" if last else None))]
        usage = {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n, "completion_tokens": n}}
        events[-1] += _chunk(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"
                             + b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.tr.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.ticker.streams.append([self.tr, events, 0])


def fake_worker(port: int, token_ms: float, tokens: int, interval: int, style: str) -> None:
    global _separators
    _separators = _JSON[style]

    async def main() -> None:
        ticker = _Ticker(token_ms / 1000.0)
        server = await asyncio.get_running_loop().create_server(lambda: _WorkerProtocol(ticker, tokens, interval),
                                                                 "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    asyncio.run(main())


# ----------------------------------------------------------------------------- the client (this process)

class _ClientProtocol(asyncio.Protocol):
    """One keep-alive connection to a router: requests one after another, counting the tokens it gets."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.stats = stats
        self.tr: asyncio.Transport | None = None
        self.done: asyncio.Future[bytes] | None = None
        self.tail = b""
        self.body_head = b""
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.tr = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("router closed the connection"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        if len(self.body_head) < 64:
            self.body_head += data[:64]
        joined = self.tail + data
        # every token's text is " w<id>" (the fake's), and no other part of the router's chunks has " w"
        self.stats["tokens"] += joined.count(b" w") - self.tail.count(b" w")
        self.tail = joined[-32:]
        if self.tail.endswith(b"\r\n0\r\n\r\n") and self.done is not None and not self.done.done():
            self.done.set_result(self.tail)

    async def request(self, payload: bytes) -> None:
        assert self.tr is not None
        self.done = asyncio.get_running_loop().create_future()
        self.tail = self.body_head = b""
        self.tr.write(payload)
        tail = await self.done
        if not self.body_head.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in tail:
            raise RuntimeError(f"unexpected answer: {self.body_head!r}")


def _payload(port: int, tokens: int, k: int) -> bytes:
    prompt = " ".join(f"w{2 + (k + i) % 190}" for i in range(32))
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (port, len(body), body))


async def _drive(ports: list[int], streams: int, tokens: int, warmup_s: float, window_s: float,
                 cpu: Any) -> dict[str, Any]:
    """``streams`` closed-loop clients split across ``ports``; events and CPU counted over the window only."""
    loop = asyncio.get_running_loop()
    stats = {"tokens": 0, "completed": 0, "failed": 0}
    phase = {"measuring": False, "stop": False}

    async def client(i: int) -> None:
        port = ports[i % len(ports)]
        _, proto = await loop.create_connection(lambda: _ClientProtocol(stats), "127.0.0.1", port)
        k = i
        try:
            while not phase["stop"]:
                try:
                    await proto.request(_payload(port, tokens, k))
                    if phase["measuring"]:
                        stats["completed"] += 1
                except (RuntimeError, ConnectionError):
                    stats["failed"] += 1
                    return
                k += streams
        finally:
            if proto.tr is not None:
                proto.tr.close()

    tasks = [asyncio.create_task(client(i)) for i in range(streams)]
    await asyncio.sleep(warmup_s)
    e0, c0, t0 = stats["tokens"], cpu(), time.perf_counter()
    phase["measuring"] = True
    await asyncio.sleep(window_s)
    e1, c1, t1 = stats["tokens"], cpu(), time.perf_counter()
    phase["stop"] = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    tokens_out = e1 - e0
    cpu_s = c1 - c0
    wall = t1 - t0
    return {"tokens": tokens_out, "tokens_per_s": tokens_out / wall, "router_cpu_s": cpu_s,
            "tokens_per_cpu_s": tokens_out / cpu_s if cpu_s > 0 else 0.0,
            "cpu_ms_per_token": 1000 * cpu_s / tokens_out if tokens_out else None,
            "offered_tokens_per_s": 0.0, "failed": stats["failed"]}


# ----------------------------------------------------------------------------- processes

def _cpu_s(pid: int) -> float:
    """CPU time of all a process's threads, seconds (``/proc/PID/task/*/schedstat``, nanoseconds)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def _write_model(d: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # " w7" per token after the first: the fake's texts are the tokenizer's
    tok.add_special_tokens(["</s>", "[UNK]"])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "[UNK]",
        "model_max_length": 4096}))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                                               "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64}))
    return d


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(port: int, path: str, timeout_s: float, proc: subprocess.Popen) -> None:
    import urllib.request

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"port {port} did not answer {path} within {timeout_s} s")


def _start_router(root: Path, model: Path, workers: dict[str, list[str]], log: Path, extra: tuple[str, ...] = ()
                  ) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    argv = [sys.executable, "-m", "pdserve.router", "--model-dir", str(model), "--port", str(port),
            "--log-level", "error", "--max-inflight", "100000", "--max-inflight-per-worker", "100000",
            "--health-interval-s", "2", "--no-calibrate", *extra]
    for role, urls in workers.items():
        argv += [f"--{role}", *urls]
    with open(log, "ab") as f:
        proc = subprocess.Popen(argv, cwd=str(root), env=dict(os.environ, PYTHONPATH=str(root)), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc, port


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


# ----------------------------------------------------------------------------- the bench

def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="*", default=[16, 64, 256], help="concurrent P -> D streams")
    ap.add_argument("--colocated-streams", type=int, nargs="*", default=[256], help="concurrent colocated streams")
    ap.add_argument("--routers", type=int, nargs="+", default=[1, 2], help="router processes (1 and/or 2)")
    ap.add_argument("--tokens", type=int, default=400, help="tokens per request")
    ap.add_argument("--token-ms", type=float, default=5.0, help="the fake workers' time per token")
    ap.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed event, as vLLM's "
                    "--stream-interval (the first token and the finish go at once)")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--window-s", type=float, default=8.0, help="the measured window of each case")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (each case once per round, per router tree)")
    ap.add_argument("--baseline-root", default="", help="a source tree with another pdserve to compare against")
    ap.add_argument("--quick", action="store_true", help="one round, 2 s warm-up, 4 s windows")
    ap.add_argument("--worker-json", nargs="+", choices=sorted(_JSON), default=["vllm"],
                    help="the fake workers' event JSON: vllm (its compact bytes) and/or spaced (', ' and ': '); "
                         "with both, each tree's spaced rows give the ratio spaced / vllm")
    ap.add_argument("--fake-worker", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.fake_worker:
        fake_worker(a.fake_worker, a.token_ms, a.tokens, a.stream_interval, a.worker_json[0])
        return 0
    if a.quick:
        a.repeat, a.warmup_s, a.window_s = 1, 2.0, 4.0
    trees = [("this", ROOT)] + ([("baseline", Path(a.baseline_root).resolve())] if a.baseline_root else [])
    styles = list(dict.fromkeys(a.worker_json))
    wports = {(style, role): _free_port() for style in styles for role in ("prefill", "decode", "colocated")}
    fakes = {key: subprocess.Popen([sys.executable, __file__, "--fake-worker", str(p), "--token-ms",
                                    str(a.token_ms), "--tokens", str(a.tokens), "--stream-interval",
                                    str(a.stream_interval), "--worker-json", key[0]], start_new_session=True)
             for key, p in wports.items()}
    routers: dict[tuple[str, str, int, str], list[tuple[subprocess.Popen, int]]] = {}
    rows: dict[tuple[str, str, int, int, str], list[dict[str, Any]]] = {}
    out_dir = Path(tempfile.mkdtemp(prefix="router-ceiling-"))
    try:
        for key, p in wports.items():
            _wait_http(p, "/health", 30, fakes[key])
        model = _write_model(out_dir / "model")

        def workers(mode: str, style: str) -> dict[str, list[str]]:
            roles = ("prefill", "decode") if mode == "pd" else ("colocated",)
            return {r: [f"http://127.0.0.1:{wports[(style, r)]}"] for r in roles}

        cases = [("pd", s) for s in a.streams] + [("colocated", s) for s in a.colocated_streams]
        for mode in sorted({m for m, _ in cases}):
            for name, root in trees:
                for n in a.routers:
                    for style in styles:
                        routers[(name, mode, n, style)] = [
                            _start_router(root, model, workers(mode, style), out_dir / f"{name}.log")
                            for _ in range(n)]
        for procs in routers.values():
            for proc, port in procs:
                _wait_http(port, "/ready", 180, proc)
        for rnd in range(a.repeat):
            for mode, streams in cases:
                for n in a.routers:
                    order = [(name, style) for name, _ in trees for style in styles]
                    for name, style in (order if rnd % 2 == 0 else order[::-1]):
                        procs = routers[(name, mode, n, style)]
                        pids = [p.pid for p, _ in procs]
                        row = asyncio.run(_drive([port for _, port in procs], streams, a.tokens, a.warmup_s,
                                                 a.window_s, lambda pids=pids: sum(_cpu_s(p) for p in pids)))
                        row["offered_tokens_per_s"] = streams * 1000.0 / a.token_ms
                        rows.setdefault((name, mode, n, streams, style), []).append(row)
                        failed = f", {row['failed']} failed" if row["failed"] else ""
                        print(f"  round {rnd + 1}: {name:8} {mode:9} {style:6} routers={n} streams={streams:4}: "
                              f"{row['tokens_per_s']:9.0f} tok/s, {row['tokens_per_cpu_s']:9.0f} tok/router-CPU-s"
                              f"{failed}", flush=True)
    finally:
        for procs in routers.values():
            for proc, _ in procs:
                _stop(proc)
        for f in fakes.values():
            _stop(f)

    table = []
    for (name, mode, n, streams, style), rs in sorted(rows.items(), key=lambda kv: (
            kv[0][1] != "pd", kv[0][1], kv[0][3], kv[0][2], kv[0][4] != "vllm", kv[0][0])):
        tpc, tps = _median(rs, "tokens_per_cpu_s"), _median(rs, "tokens_per_s")
        entry = {"tree": name, "mode": mode, "worker_json": style, "routers": n, "streams": streams,
                 "tokens_per_s": round(tps or 0),
                 "offered_tokens_per_s": round(streams * 1000.0 / a.token_ms),
                 "tokens_per_router_cpu_s": round(tpc or 0),
                 "router_cpu_ms_per_token": round(1000 / tpc, 4) if tpc else None,
                 "rounds": len(rs), "failed": sum(r["failed"] for r in rs)}
        base = rows.get(("baseline", mode, n, streams, style))
        if name == "this" and base:
            btpc, btps = _median(base, "tokens_per_cpu_s"), _median(base, "tokens_per_s")
            entry["vs_baseline_tokens_per_cpu_s"] = round(tpc / btpc, 3) if tpc and btpc else None
            entry["vs_baseline_tokens_per_s"] = round(tps / btps, 3) if tps and btps else None
        compact = rows.get((name, mode, n, streams, "vllm"))
        if style != "vllm" and compact:
            ctpc = _median(compact, "tokens_per_cpu_s")
            entry["vs_vllm_json_tokens_per_cpu_s"] = round(tpc / ctpc, 3) if tpc and ctpc else None
        one = rows.get((name, mode, 1, streams, style))
        if n > 1 and one:
            entry["vs_one_router_tokens_per_s"] = round(tps / _median(one, "tokens_per_s"), 3) if tps else None
        table.append(entry)
    cols = ["tree", "mode", "worker_json", "routers", "streams", "offered_tokens_per_s", "tokens_per_s",
            "tokens_per_router_cpu_s", "router_cpu_ms_per_token", "vs_baseline_tokens_per_cpu_s",
            "vs_vllm_json_tokens_per_cpu_s", "vs_one_router_tokens_per_s", "failed"]
    print(f"\nrouter ceiling: fake vLLM-shaped workers, {a.tokens} tokens a request, a token every "
          f"{a.token_ms:g} ms, {a.stream_interval} token(s) an event; medians of {a.repeat} round(s), "
          f"{a.window_s:g} s windows; {os.cpu_count()} CPUs")
    print(" | ".join(f"{c:>12}" for c in cols))
    for e in table:
        print(" | ".join(f"{e.get(c, '')!s:>12}" for c in cols))
    head = next((e for e in table if e["tree"] == "this" and e["mode"] == "pd" and e["routers"] == 1
                 and e["streams"] == max(a.streams) and e["worker_json"] == styles[0]), None) if a.streams else None
    spaced = next((e for e in table if e["tree"] == "this" and e["mode"] == "pd" and e["routers"] == 1
                   and e["streams"] == max(a.streams) and e["worker_json"] == "spaced"), None) if a.streams else None
    print(json.dumps({"bench": "router_ceiling", "tokens": a.tokens, "token_ms": a.token_ms,
                      "stream_interval": a.stream_interval, "window_s": a.window_s,
                      "repeat": a.repeat, "cpus": os.cpu_count(), "baseline_root": a.baseline_root or None,
                      "rows": table,
                      "ratio": head.get("vs_baseline_tokens_per_cpu_s") if head else None,
                      "ratio_means": f"tokens per router CPU-second, this / baseline, P -> D, 1 router, "
                                     f"{max(a.streams) if a.streams else 0} streams, {styles[0]} JSON",
                      "spaced_ratio": spaced.get("vs_vllm_json_tokens_per_cpu_s") if spaced else None,
                      "spaced_ratio_means": "tokens per router CPU-second, this tree, re-spaced JSON / vLLM's bytes, "
                                            "same case"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
