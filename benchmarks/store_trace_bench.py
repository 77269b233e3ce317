"""KV pool on a scaled conversation trace: prefill tokens computed and TTFT p50/p99, pool vs no pool.

    python benchmarks/store_trace_bench.py [--quick] [--requests 60] [--start 0] [--input-scale 0.125]

Same run, same requests, two launches of ``pdserve serve``-equivalent clusters (2 colocated workers with
the pdserve connector, round-robin router, random-weight 8-layer Llama): ``pool`` (a master + one node, every
worker saves finished blocks and loads pooled prefixes) and ``no pool`` (the same connector, local prefix
caches only). Conversation turns land on alternating workers, so without the pool a worker recomputes a
prefix the other one computed. Requests are replayed in trace order, one at a time (TTFT without queueing).

Trace rows (Mooncake FAST'25 conversation trace): prompts are built from ``hash_ids`` (equal ids = equal
512-token blocks, scaled by ``--input-scale``); the prefix reuse ratio of the chosen rows (tokens shared
with an earlier row / all tokens) is printed next to the trace's 37%. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.bench.traces import TraceRow, conversation_rows, default_trace, load_trace  # noqa: E402
from pdserve.launch import Cluster  # noqa: E402
from pdserve.launch.config import LauncherConfig  # noqa: E402
from pdserve.launch.models import build_random_llama  # noqa: E402

TRACE_BLOCK = 512


def select_rows(path: Path, start: int, n: int, target: float) -> list[TraceRow]:
    """``n`` rows from ``start`` on with prefix reuse near ``target``: conversations' later turns together with the
    earlier turn they extend (:func:`pdserve.bench.traces.conversation_rows`; consecutive rows reuse only ~5%: a
    conversation's turns are far apart in the trace)."""
    return conversation_rows(load_trace(path, start), n, target)


def build_prompts(rows: list[TraceRow], scale: float, max_input: int, vocab: int) -> list[list[int]]:
    block = max(1, round(TRACE_BLOCK * scale))
    out = []
    for row in rows:
        toks: list[int] = []
        for h in row.hash_ids:
            toks += np.random.default_rng(1_000_003 + h).integers(1000, vocab, block).tolist()
        out.append(toks[:min(max_input, max(block, round(row.input_length * scale)))])
    return out


def reuse_ratio(prompts: list[list[int]]) -> float:
    shared = total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            for a, b in zip(p, q):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        shared += best
        total += len(p)
    return shared / max(total, 1)


def stream_ttft(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if first is None and line.startswith("data:") and line != "data: [DONE]":
                first = time.perf_counter() - t0
    return first if first is not None else float("nan")


def scrape(urls: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for u in urls:
        with urllib.request.urlopen(u + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("#") or " " not in line:
                    continue
                name, value = line.rsplit(" ", 1)
                if name.split("{")[0].endswith("_created"):
                    continue
                key = None
                if name.startswith("vllm:prompt_tokens_by_source"):
                    key = "src_" + name.split('source="')[1].split('"')[0]
                elif name.startswith(("vllm:prompt_tokens_total", "vllm:pdserve_kv_pool_")):
                    key = name.split("{")[0]
                if key:
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def run_config(pool: bool, model: Path, prompts: list[list[int]], max_tokens: int, max_len: int) -> dict:
    cfg = LauncherConfig(model=str(model), colocated=2, connector=True, pool=pool, port=0, dtype="bfloat16",
                         max_model_len=max_len, kv_cache_gib=1, pool_mem="1GiB",
                         worker_args=("--max-num-seqs", "8"))
    with Cluster(cfg, log=lambda s: print(f"  [{'pool' if pool else 'no pool'}] {s}", file=sys.stderr)) as c:
        urls = c.worker_urls()
        stream_ttft(c.router_url, c.model_name, list(range(1000, 1100)), 2)  # warm-up (not in the trace)
        before = scrape(urls)
        ttfts = []
        for p in prompts:
            ttfts.append(stream_ttft(c.router_url, c.model_name, p, max_tokens))
            if pool:
                time.sleep(0.05)  # saves are asynchronous; give the next turn a fair chance to find them
        time.sleep(6)  # vLLM publishes connector counters with its periodic stats
        after = scrape(urls)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {"ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p99_ms": 1e3 * pct(ttfts, 99),
            "ttft_mean_ms": 1e3 * statistics.fmean(ttfts), "prompt_tokens": d.get("vllm:prompt_tokens_total", 0),
            "computed_tokens": d.get("src_local_compute", 0), "local_hit_tokens": d.get("src_local_cache_hit", 0),
            "external_tokens": d.get("src_external_kv_transfer", 0),
            "pool_loaded_tokens": d.get("vllm:pdserve_kv_pool_loaded_tokens_total", 0),
            "pool_saved_blocks": d.get("vllm:pdserve_kv_pool_saved_blocks_total", 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="24 requests")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--start", type=int, default=0, help="first trace row")
    ap.add_argument("--input-scale", type=float, default=0.125)
    ap.add_argument("--target-reuse", type=float, default=0.32,
                    help="block-level reuse to aim the row choice at (0.32 gives 36%% token-level reuse with the "
                         "defaults; the whole trace: 37%%)")
    ap.add_argument("--max-input", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--trace", default=str(default_trace()), help="Mooncake trace, .jsonl or .jsonl.gz "
                    "(default: $PDSERVE_TRACE or the packaged conversation trace)")
    ap.add_argument("--model-dir", default=os.environ.get("PDSERVE_BENCH_MODEL", "/tmp/pd-store/models/llama-8l"))
    args = ap.parse_args()
    n = 24 if args.quick else args.requests
    model = build_random_llama(args.model_dir, layers=8, hidden=768, heads=12, kv_heads=4, intermediate=2048,
                               dtype="bfloat16")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = select_rows(Path(args.trace), args.start, n, args.target_reuse)
    prompts = build_prompts(rows, args.input_scale, args.max_input, vocab)
    ratio = reuse_ratio(prompts)
    max_len = args.max_input + args.max_tokens + 16
    print(f"{len(prompts)} requests chosen from trace rows >= {args.start} (see select_rows), "
          f"{sum(map(len, prompts))} prompt tokens, prefix reuse {ratio:.1%} (whole trace: 37%)", file=sys.stderr)
    res = {name: run_config(pool, model, prompts, args.max_tokens, max_len)
           for name, pool in (("no_pool", False), ("pool", True))}
    cols = ("prompt_tokens", "computed_tokens", "local_hit_tokens", "pool_loaded_tokens", "ttft_p50_ms",
            "ttft_p99_ms")
    print(f"{'config':<10}" + "".join(f"{c:>20}" for c in cols))
    for name, r in res.items():
        print(f"{name:<10}" + "".join(f"{r[c]:>20.1f}" for c in cols))
    base, pool = res["no_pool"], res["pool"]
    out = {"requests": len(prompts), "reuse_ratio": round(ratio, 4),
           **{f"{k}_{c}": round(v[c], 2) for k, v in res.items() for c in cols + ("pool_saved_blocks",)},
           "computed_ratio": round(pool["computed_tokens"] / max(base["computed_tokens"], 1), 3),
           "ttft_p50_ratio": round(pool["ttft_p50_ms"] / base["ttft_p50_ms"], 3),
           "ttft_p99_ratio": round(pool["ttft_p99_ms"] / base["ttft_p99_ms"], 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
