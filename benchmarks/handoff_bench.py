"""Hand-off time (issue 16, item 2): P's answer -> D's first token, and where it goes, under load, with D's
connector loading P's KV synchronously (small reads, the default) against the asynchronous load of before
(``sync_load_max_bytes=0``), on the same prompts, in the same run.

    PYTHONPATH=$PWD python benchmarks/handoff_bench.py [--requests 60] [--rounds 4] [--concurrency 4] [--output 32]

For each mode a real 1P1D stack is started through the launcher (router, P and D vLLM CPU workers, one core
each, the same two cores for both stacks; KV pool off unless ``--pool``) on a random fp32 Llama from
``pdserve.launch.models`` (``--layers``, ``--hidden``). Both stacks stay up and take the load in turns
(``--rounds`` rounds, each a slice of the prompts on one stack then the same slice on the other), so a busy
shared machine weighs on both alike. ``--concurrency`` closed-loop clients stream completions of
``--min-prompt``..``--max-prompt`` random token ids with ``--output`` tokens each (greedy, ignore_eos), so D
is decoding other requests while a hand-off lands. Per request:

* the router's ``handoff_ms`` (``pdserve_timings``: P's answer -> D's first token at the router);
* ``handoff_over_tpot``: that hand-off over the same request's TPOT (the hand-off counted in D's decode steps,
  which a machine shared with other work slows for both modes alike);
* the client's hand-off: the arrival of the first token (P's, streamed at once) -> the second (D's first);
* D's stamps from its connector's ``hand-off`` log line (``pdserve.vllm.stamps``; same host, same wall clock),
  joined on the prompt's hash, split into phases that add up to the client's hand-off:
  ``to_d`` (client's t1 -> D's vLLM has the request: router -> D HTTP, D's input processing),
  ``to_admit`` (-> D's scheduler first considers it), ``admit_to_sched`` (-> the step that computes its first
  token is scheduled: for async loads the read, the step that reports it and the next schedule),
  ``sched_to_done`` (that step: for sync loads the read plus the forward), ``done_to_client`` (D's output ->
  API process -> router -> client); and inside them ``read`` (the READ itself), ``read_begin_lag`` (alloc ->
  the read starts) and ``report_lag`` (the read ends -> the scheduler hears it).

``--direct N`` adds a same-stack A/B that no machine noise can tilt: on the sync stack, the benchmark itself
plays the router for N more requests (P's one-token call, then D's streamed decode of prompt + t1 with P's
``kv_transfer_params``), alternating per request between the default (sync) and ``pdserve_load: async``
(the old path); hand-off = P's answer received -> D's first token received.

Prints a table per mode (p50 / p99 ms), the ratio sync / async of the hand-off, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.vllm.params import prompt_hash  # noqa: E402

T = TypeVar("T")
R = TypeVar("R")
MODES = {"async": {"sync_load_max_bytes": 0}, "sync": {}}  # sync: the connector's default threshold
PHASES = ("to_d", "to_admit", "admit_to_sched", "sched_to_done", "done_to_client", "read", "read_begin_lag",
          "report_lag")


def percentile(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    s = sorted(vals)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 3)


def stream_one(host: str, port: int, model: str, prompt: list[int], output: int) -> dict[str, Any]:
    """One streamed completion through the router: wall-clock arrival of every token chunk, and its timings."""
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "stream": True, "pdserve_timings": True}
    conn = http.client.HTTPConnection(host, port, timeout=300)
    t0 = time.time()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"router answered {resp.status}: {resp.read()[:300]!r}")
    stamps: list[float] = []
    timings: dict[str, Any] = {}
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        now = time.time()
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.splitlines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if obj.get("pdserve_timings"):
                    timings = obj["pdserve_timings"]
                for c in obj.get("choices") or []:
                    if c.get("text"):
                        stamps.append(now)
    conn.close()
    return {"t0": t0, "stamps": stamps, "timings": timings, "hash": prompt_hash(prompt, len(prompt))}


def _post(url: str, body: dict) -> http.client.HTTPResponse:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url} answered {resp.status}: {resp.read()[:300]!r}")
    return resp


def direct_one(p_url: str, d_url: str, model: str, prompt: list[int], output: int, load: str) -> dict[str, Any]:
    """The router's P -> D hand-off played by the benchmark, D's load mode chosen per request."""
    base = {"model": model, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with _post(p_url, {**base, "prompt": prompt, "max_tokens": 1,
                       "kv_transfer_params": {"do_remote_decode": True}}) as resp:
        pr = json.loads(resp.read())
    t_p = time.time()
    t1 = pr["choices"][0]["token_ids"]
    params = dict(pr["kv_transfer_params"], pdserve_load=load)
    first = None
    with _post(d_url, {**base, "prompt": prompt + t1, "max_tokens": output - 1, "stream": True,
                       "kv_transfer_params": params}) as resp:
        for raw in resp:
            line = raw.strip()
            if first is None and line.startswith(b"data:") and line != b"data: [DONE]":
                if any(c.get("token_ids") for c in json.loads(line[5:]).get("choices") or []):
                    first = time.time()
    return {"load": load, "handoff": (first - t_p) * 1e3 if first else None, "t_p": t_p, "first": first,
            "hash": prompt_hash(prompt, len(prompt))}


def closed_loop(fn: Callable[[T], R], jobs: list[T], concurrency: int) -> list[R]:
    """``fn`` over ``jobs`` by ``concurrency`` closed-loop clients (each takes the next job when its last ends), in
    the jobs' order."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(fn, jobs))


def run_direct(cluster: Any, prompts: list[list[int]], output: int, concurrency: int) -> dict[str, Any]:
    """Same stack, same moment: alternate sync (default) and async per request."""
    p_url = next(w.url for w in cluster.workers if w.name.startswith("prefill"))
    d_url = next(w.url for w in cluster.workers if w.name.startswith("decode"))
    def one(job: tuple[list[int], str]) -> dict:
        prompt, load = job
        try:
            return direct_one(p_url, d_url, cluster.model_name, prompt, output, load)
        except Exception as exc:  # counted, never silently dropped
            return {"load": load, "handoff": None, "error": f"{type(exc).__name__}: {exc}"}

    recs = closed_loop(one, [(prompt, "auto" if i % 2 else "async") for i, prompt in enumerate(prompts)],
                       concurrency)
    out: dict[str, Any] = {"errors": sum(1 for r in recs if r.get("error"))}
    for load, name in (("async", "async"), ("auto", "sync")):
        vals = [r["handoff"] for r in recs if r["load"] == load and r["handoff"] is not None]
        out[name] = {"p50": percentile(vals, 0.5), "p99": percentile(vals, 0.99), "n": len(vals)}
    b, s = out["async"]["p50"], out["sync"]["p50"]
    out["sync_over_async_p50"] = round(s / b, 3) if b and s else None
    b, s = out["async"]["p99"], out["sync"]["p99"]
    out["sync_over_async_p99"] = round(s / b, 3) if b and s else None
    return out


def run_load(url: str, model: str, prompts: list[list[int]], output: int, concurrency: int) -> list[dict]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    errors: list[str] = []

    def one(prompt: list[int]) -> dict | None:
        try:
            return stream_one(host, int(port), model, prompt, output)
        except Exception as exc:  # counted and reported, never silently dropped
            errors.append(f"{type(exc).__name__}: {exc}")
            return None

    done = closed_loop(one, prompts, concurrency)
    if errors:
        print(f"[handoff_bench] {len(errors)} failed requests, first: {errors[0]}", file=sys.stderr)
    return [r for r in done if r is not None]


def d_stamps(run_dir: Path) -> dict[str, dict]:
    """prompt hash -> D's connector ``hand-off`` line (the last one for that prompt)."""
    found: dict[str, dict] = {}
    for log in sorted(run_dir.glob("decode*.log")):
        for line in log.read_text(errors="replace").splitlines():
            at = line.find("] hand-off {")
            if at >= 0:
                rec = json.loads(line[at + len("] hand-off "):])
                found[rec["prompt_hash"]] = rec
    return found


def phases(rec: dict, st: dict | None) -> dict[str, float]:
    """One request's hand-off phases in ms (client clock = D's clock: same host)."""
    out: dict[str, float] = {}
    if len(rec["stamps"]) < 2:
        return out
    c1, c2 = rec["stamps"][0], rec["stamps"][1]
    out["client_handoff"] = (c2 - c1) * 1e3
    t, tpot = rec["timings"].get("handoff_ms"), rec["timings"].get("tpot_ms")
    if t is not None:
        out["router_handoff"] = float(t)
        if tpot:  # the hand-off in D's decode steps of that request: what a busy shared machine cannot tilt
            out["handoff_over_tpot"] = float(t) / float(tpot)
    if not st:
        return out

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (b - a) * 1e3

    pairs = {"to_d": (c1, st.get("arrive")), "to_admit": (st.get("arrive"), st.get("admit")),
             "admit_to_sched": (st.get("admit"), st.get("sched")), "sched_to_done": (st.get("sched"), st.get("done")),
             "done_to_client": (st.get("done"), c2), "read": (st.get("read_start"), st.get("read_end")),
             "read_begin_lag": (st.get("alloc"), st.get("read_start")),
             "report_lag": (st.get("read_end"), st.get("seen"))}
    for name, (a, b) in pairs.items():
        v = span(a, b)
        if v is not None:
            out[name] = v
    out["bytes"] = float(st.get("bytes") or 0)
    return out


def start(mode: str, model: Path, a: argparse.Namespace, stack: contextlib.ExitStack) -> Any:
    from pdserve.bench.compare import CompareSettings, launcher_config
    from pdserve.launch import Cluster

    run_dir = Path(tempfile.mkdtemp(prefix=f"handoff-{mode}-"))
    cfg = launcher_config("1p1d", CompareSettings(model=str(model), dtype="float32", max_model_len=a.max_model_len,
                                                  run_dir=str(run_dir)))
    cfg = dataclasses.replace(cfg, pool=a.pool, connector_extra={**cfg.connector_extra, **MODES[mode]})
    t0 = time.monotonic()
    c = stack.enter_context(Cluster(cfg))
    print(f"[handoff_bench] {mode}: up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return c


def summarize(recs: list[dict], logs: Path, wall: float) -> dict[str, Any]:
    stamps = d_stamps(logs)
    rows = [phases(r, stamps.get(r["hash"])) for r in recs]
    modes = [stamps[r["hash"]]["mode"] for r in recs if r["hash"] in stamps]
    out: dict[str, Any] = {"requests": len(recs), "wall_s": round(wall, 1), "joined": len(modes),
                           "load_modes": {m: modes.count(m) for m in set(modes)}}
    for key in ("router_handoff", "client_handoff", "handoff_over_tpot") + PHASES:
        vals = [r[key] for r in rows if key in r]
        out[key] = {"p50": percentile(vals, 0.5), "p99": percentile(vals, 0.99), "n": len(vals)}
    tpot = [float(r["timings"]["tpot_ms"]) for r in recs if r["timings"].get("tpot_ms") is not None]
    out["tpot"] = {"p50": percentile(tpot, 0.5), "p99": percentile(tpot, 0.99), "n": len(tpot)}
    kv = [r["bytes"] for r in rows if r.get("bytes")]
    out["kv_bytes_mean"] = round(statistics.mean(kv)) if kv else None
    return out


def run_modes(modes: list[str], model: Path, prompts: list[list[int]], warmup: list[list[int]],
              direct: list[list[int]], a: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Start every mode's stack, then give them the same prompt slices in turns."""
    with contextlib.ExitStack() as stack:
        clusters = {m: start(m, model, a, stack) for m in modes}
        for c in clusters.values():
            run_load(c.router_url, c.model_name, warmup, a.output, a.concurrency)
        recs: dict[str, list[dict]] = {m: [] for m in modes}
        wall = dict.fromkeys(modes, 0.0)
        size = -(-len(prompts) // a.rounds)
        for r in range(a.rounds):
            part = prompts[r * size:(r + 1) * size]
            for m in modes if r % 2 == 0 else modes[::-1]:
                t0 = time.monotonic()
                recs[m] += run_load(clusters[m].router_url, clusters[m].model_name, part, a.output, a.concurrency)
                wall[m] += time.monotonic() - t0
            print(f"[handoff_bench] round {r + 1}/{a.rounds} done", file=sys.stderr)
        ab = run_direct(clusters["sync"], direct, a.output, a.concurrency) if direct and "sync" in clusters else {}
        logs = {m: Path(c.run_dir) for m, c in clusters.items()}
    return {m: summarize(recs[m], logs[m], wall[m]) for m in modes}, ab


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="turns per mode (the prompts are split between them)")
    p.add_argument("--direct", type=int, default=40, help="same-stack A/B requests, alternating sync and async")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--min-prompt", type=int, default=80)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--pool", action="store_true", help="keep the KV pool on (off by default: only P -> D)")
    p.add_argument("--model", default="", help="model folder (default: a random Llama built here)")
    a = p.parse_args(argv)
    from pdserve.launch.models import build_random_llama

    model = Path(a.model) if a.model else build_random_llama(
        Path(tempfile.mkdtemp(prefix="handoff-bench-")) / "random-llama", layers=a.layers, hidden=a.hidden,
        heads=a.hidden // 64, kv_heads=max(1, a.hidden // 128), intermediate=3 * a.hidden)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(16)

    def prompt() -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(rng.randint(a.min_prompt, a.max_prompt))]

    warmup = [prompt() for _ in range(a.warmup)]
    prompts = [prompt() for _ in range(a.requests)]
    direct = [prompt() for _ in range(a.direct)]
    results, ab = run_modes(a.modes.split(","), model, prompts, warmup, direct, a)
    print(f"{a.requests} requests x {a.output} tokens, prompts {a.min_prompt}-{a.max_prompt} tokens, concurrency "
          f"{a.concurrency}, model {a.layers} layers x {a.hidden} fp32; ms, p50 / p99")
    names = list(results)
    print("| phase | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for key in ("router_handoff", "client_handoff", "handoff_over_tpot") + PHASES + ("tpot",):
        cells = [f"{r[key]['p50']} / {r[key]['p99']}" for r in results.values()]
        print(f"| {key} | " + " | ".join(cells) + " |")
    print("| load modes (D's log) | " + " | ".join(str(r["load_modes"]) for r in results.values()) + " |")
    ratio: dict[str, Any] = {}
    if "async" in results and "sync" in results:
        for q in ("p50", "p99"):
            b, s = results["async"]["router_handoff"][q], results["sync"]["router_handoff"][q]
            ratio[f"router_handoff_{q}"] = round(s / b, 3) if b and s else None
        print(f"sync / async router hand-off: p50 {ratio['router_handoff_p50']}x, p99 {ratio['router_handoff_p99']}x")
    if ab:
        print(f"same-stack A/B (benchmark as router, {ab['async']['n']} + {ab['sync']['n']} requests): hand-off async "
              f"{ab['async']['p50']} / {ab['async']['p99']} ms, sync {ab['sync']['p50']} / {ab['sync']['p99']} ms "
              f"(p50 {ab['sync_over_async_p50']}x, p99 {ab['sync_over_async_p99']}x)")
    print(json.dumps({"bench": "handoff", "requests": a.requests, "concurrency": a.concurrency, "output": a.output,
                      "prompt_tokens": [a.min_prompt, a.max_prompt], "model": {"layers": a.layers, "hidden": a.hidden},
                      "results": results, "sync_over_async": ratio, "same_stack_ab": ab}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
