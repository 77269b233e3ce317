"""A running decode moved off a worker that starts a long prefill (issue 16, item 1), on real vLLM workers: an
elastic router over two kv_both workers, a decode R streaming on worker A, then a long prompt whose prefill the
conductor puts on A; R moves to B (A prefills R's prompt + streamed tokens from its prefix cache, B reads that KV
through the connector) and its greedy output equals one worker's, token for token. (A second decode S runs on B;
when the conductor puts L's prefill on B instead, S is the one that moves to A: both are checked alike.) Run from a test module that
owns a stack of two kv_both workers (tests/integration/test_pd_router.py)."""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pdserve.bench.prom import scrape
from pdserve.launch.procs import free_port, spawn_healthy, stop_children

# R and S short (colocated: R on one worker, then S on the other, the first being busy), L long (> 256 tokens: its
# prefill goes on one of them, and the decode running there moves to the other). R and S must still be decoding when
# L is placed, whatever this machine's speed: their lengths are sized from a decode timed on the workers first
# (DECODE_S of decoding each; one fast CPU made R's 220 tokens in 0.84 s, before S was even placed).
R_PROMPT, S_PROMPT, L_PROMPT = 20, 250, 1000
MIN_TOKENS, MAX_TOKENS = 220, 1500  # R's context stays under --max-model-len 2048 with S's prompt
DECODE_S = 5.0


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _body(length: int, seed: int, max_tokens: int) -> dict:
    rng = random.Random(seed)
    return {"model": "rl", "prompt": [rng.randrange(1000, 40000) for _ in range(length)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


class Streamed(threading.Thread):
    """A streamed completion read in a thread: its text, and an event set at its first chunk."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.text, self.error = "", ""
        self.started = threading.Event()

    def run(self) -> None:
        try:
            req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(self.body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                for line in resp:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        self.error = json.dumps(obj)
                    for c in obj.get("choices") or []:
                        self.text += c.get("text") or ""
                        self.started.set()
        except Exception as e:  # reported by the test
            self.error = repr(e)
        finally:
            self.started.set()


def _metric(url: str, name: str) -> float:
    return scrape(url, name).get(name, 0.0)


@contextmanager
def elastic_router(model_dir: str, urls: list[str], log: Path) -> Iterator[str]:
    """A conductor router over ``urls`` as one elastic pool (no calibration, prompts over 256 uncached tokens
    long); yields its URL once healthy, stops it (and anything it started) afterwards."""
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    child = spawn_healthy("elastic-router", [
        sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(port), "--model-dir", model_dir,
        "--served-model-name", "rl", "--max-model-len", "2048", "--policy", "conductor", "--no-calibrate",
        "--local-prefill-tokens", "256", "--log-level", "debug", "--elastic", *urls], router, timeout_s=120,
        log_path=log)
    try:
        yield router
    finally:
        stop_children([child])


def _failed_reads(logs: list[Path]) -> str:
    """The workers' log lines on failed KV reads (what a failed count assertion shows)."""
    keys = ("failed (", "checksum failure", "could not tell")
    return "\n".join(line for p in logs if p.exists() for line in p.read_text(errors="replace").splitlines()
                     if any(k in line for k in keys))[-4000:]


def _conductor_lines(log: Path) -> str:
    """The router's lines on placements and moves (debug level)."""
    return "\n".join(line for line in log.read_text(errors="replace").splitlines()
                     if "conductor" in line or "move" in line)[-4000:]


def decode_tokens(url: str, seconds: float = DECODE_S, probe: int = 128) -> int:
    """How many greedy tokens take about ``seconds`` to decode on the worker at ``url`` (timed on ``probe``
    tokens there, prompt included, so an overestimate of the step), within [MIN_TOKENS, MAX_TOKENS]."""
    t0 = time.perf_counter()
    _post(url, _body(R_PROMPT, 30, probe))
    step = (time.perf_counter() - t0) / probe
    return max(MIN_TOKENS, min(MAX_TOKENS, math.ceil(seconds / step)))


def _counters(urls: Sequence[str]) -> dict[str, dict[str, float]]:
    return {u: {k: _metric(u, f"vllm:pdserve_kv_{k}_total") for k in ("reads", "read_failures", "released_notified")}
            for u in urls}


def run_move_case(model_dir: str, urls: list[str], tmp: Path, logs: Sequence[Path] = ()) -> None:
    """The case above over the kv_both workers at ``urls``; ``logs``: their log files, quoted when a read
    failed. Which worker L prefills on is the conductor's choice (the one whose decode's context is the smaller,
    which depends on how far R got before S started): the test reads it from the workers' own counters (the source
    of the move freed two leases, L's split and the move's tail; the destination read both) and checks every
    stream's output against one worker's, so it holds whichever decode moved."""
    tokens = min(decode_tokens(u) for u in urls)
    with elastic_router(model_dir, urls, tmp / "moves-router.log") as router:
        before = _counters(urls)
        r_body, s_body, l_body = _body(R_PROMPT, 31, tokens), _body(S_PROMPT, 32, tokens), _body(L_PROMPT, 33, 4)
        r = Streamed(router, r_body)
        r.start()
        assert r.started.wait(60), "R never started"
        s = Streamed(router, s_body)  # S decodes on the other worker (R's is busy)
        s.start()
        assert s.started.wait(60), "S never started"
        long_out = _post(router, l_body)  # its prefill goes on one of the two: the decode there moves
        r.join(300)
        s.join(300)
        assert not r.is_alive() and not s.is_alive() and not r.error and not s.error, (r.error, s.error)
        lines = _conductor_lines(tmp / "moves-router.log")
        moved = _metric(router, "pdserve_router_moves_total")
        assert moved == 1.0, (moved, tokens, lines)
        assert _metric(router, "pdserve_router_move_gap_seconds_count") == 1.0
        print(f"{tokens} tokens per decode; move gap (stop on the source -> first token after the move): "
              f"{_metric(router, 'pdserve_router_move_gap_seconds_sum') * 1e3:.0f} ms")
        assert scrape(router, "pdserve_router_migrations_total") == {}  # not a failure
        # token for token what one worker alone produces, whichever of R and S moved
        ref = urls[0]
        assert r.text == _post(ref, r_body)["choices"][0]["text"]
        assert s.text == _post(ref, s_body)["choices"][0]["text"]
        assert long_out["choices"][0]["text"] == _post(ref, l_body)["choices"][0]["text"]
        after = _counters(urls)
        grew = {u: {k: after[u][k] - before[u][k] for k in before[u]} for u in urls}
        # the destination read two KV hand-offs from the source (L's split and the move), none failed (nothing
        # recomputed); the source freed both leases on the destination's notification, not at the lease's end
        src = [u for u in urls if grew[u]["released_notified"] == 2]
        dst = [u for u in urls if grew[u]["reads"] == 2]
        assert len(src) == 1 and dst == [u for u in urls if u not in src], (grew, lines, _failed_reads(list(logs)))
        assert all(g["read_failures"] == 0 for g in grew.values()), _failed_reads(list(logs))
        deadline = time.monotonic() + 20  # well inside the 30 s lease: freeing came from the hand-off
        while time.monotonic() < deadline and any(_metric(u, "vllm:kv_cache_usage_perc") for u in urls):
            time.sleep(0.2)
        assert [_metric(u, "vllm:kv_cache_usage_perc") for u in urls] == [0.0, 0.0], "KV blocks still held"
        assert [_metric(u, "vllm:num_requests_running") for u in urls] == [0.0, 0.0]
