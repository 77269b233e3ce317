"""Issue 15's costs: n=4 and a json_schema request through 1P1D vs one worker, in one run.

    python benchmarks/api_bench.py [--model DIR] [--requests N] [--prompt-tokens L] [--output-tokens T]

Starts one 1P1D stack (pdserve connector, router in front) and streams, one at a time, the same requests
(a fresh random prompt each, so no prefix-cache hits across requests) through the router and to the decode worker
alone (the one-worker baseline: same process, same model, no hand-off). Rows:
- ``plain``: n=1, free text (the reference path: P's first token goes out at once);
- ``n4``: n=4 (through the router: four Generations, the prompt prefilled once then served from P's and D's
  prefix caches; on one worker: vLLM's n=4);
- ``json_schema``: ``response_format`` json_schema (through the router: P computes the KV only, D generates every
  token under the grammar, so TTFT includes the hand-off: the "first-token handling" cost of item 5).
TTFT is the client's clock to the first content chunk (any choice); TPOT is (last - first) / (tokens - 1) per
choice. Prints a table and a final JSON line with p50s and the PD / one-worker ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pdserve.launch import Cluster  # noqa: E402
from pdserve.launch.config import LauncherConfig  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 6}},
          "required": ["name", "tags"], "additionalProperties": False}
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "n4": {"n": 4, "temperature": 0.8, "seed": 1},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
}


def _stream(url: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """(TTFT s, TPOTs s per choice) of one streamed completion."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first: float | None = None
    stamps: dict[int, list[float]] = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            now = time.perf_counter()
            for c in obj.get("choices") or []:
                n = len(c.get("token_ids") or [])
                if n:
                    first = now if first is None else first
                    stamps.setdefault(c["index"], []).extend([now] * n)
    assert first is not None, "no token arrived"
    tpots = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1]
    return first - t0, tpots


def run_case(url: str, case: dict[str, Any], args: argparse.Namespace, seed: int) -> dict[str, float]:
    ttfts, tpots = [], []
    rng = random.Random(seed)
    for _ in range(args.requests):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        body = {"model": "m", "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0, "stream": True,
                "return_token_ids": True, "ignore_eos": "response_format" not in case, **case}
        ttft, tp = _stream(url, body)
        ttfts.append(ttft)
        tpots += tp
    return {"ttft_ms_p50": round(statistics.median(ttfts) * 1000, 2),
            "tpot_ms_p50": round(statistics.median(tpots) * 1000, 2) if tpots else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model folder (default: a small random Llama, built once)")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    args = ap.parse_args()
    model = args.model
    if not model:
        from pdserve.launch.models import build_random_llama

        model = str(build_random_llama(os.path.join(".pdserve", "models", "random-llama")))
    cfg = LauncherConfig(model=model, prefill=1, decode=1, port=0, dtype="float32", max_model_len=4096,
                         served_model_name="m", worker_timeout_s=600)
    rows: dict[str, dict[str, Any]] = {}
    with Cluster(cfg, log=lambda s: print(f"[api_bench] {s}", file=sys.stderr, flush=True)) as cluster:
        one = cluster.worker_urls("decode")[0]
        for name, case in CASES.items():
            _stream(cluster.router_url, {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "stream": True,
                                         "return_token_ids": True, **case})  # warm both paths (grammar compile)
            _stream(one, {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "stream": True,
                          "return_token_ids": True, **case})
            pd = run_case(cluster.router_url, case, args, seed=1)
            alone = run_case(one, case, args, seed=2)
            rows[name] = {"pd": pd, "one_worker": alone,
                          "ttft_ratio": round(pd["ttft_ms_p50"] / alone["ttft_ms_p50"], 3),
                          "tpot_ratio": round(pd["tpot_ms_p50"] / alone["tpot_ms_p50"], 3)}
    print(f"{'case':<12} {'PD TTFT ms':>11} {'1w TTFT ms':>11} {'ratio':>6} {'PD TPOT ms':>11} {'1w TPOT ms':>11} "
          f"{'ratio':>6}")
    for name, r in rows.items():
        print(f"{name:<12} {r['pd']['ttft_ms_p50']:>11} {r['one_worker']['ttft_ms_p50']:>11} {r['ttft_ratio']:>6} "
              f"{r['pd']['tpot_ms_p50']:>11} {r['one_worker']['tpot_ms_p50']:>11} {r['tpot_ratio']:>6}")
    extra = round(rows["json_schema"]["pd"]["ttft_ms_p50"] - rows["plain"]["pd"]["ttft_ms_p50"], 2)
    print(f"json_schema first-token handling (D regenerates t1): PD TTFT +{extra} ms over plain PD")
    print(json.dumps({"bench": "api", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                      "requests": args.requests, "rows": rows, "json_schema_extra_ttft_ms": extra}))


if __name__ == "__main__":
    main()
