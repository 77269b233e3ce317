"""Issue 41's measure for seeded sampling: the share of seeded requests whose tokens through P and D equal one vLLM
worker's, per sampling parameter, one request at a time (docs/seeded-sampling.md).

    python benchmarks/seeded_sampling.py [--seeds 8] [--tokens 16] [--temperature 1] [--kv-connector nixl]

Starts a 1P1D launch of a small random Llama (fp32) and sends each case, with ``seed`` set and ``ignore_eos``, to
the router and to the decode worker's own endpoint (one worker), one request at a time; the baseline in the same
run is the one worker asked twice (vLLM's own reproducibility). The default model is a random Llama with a small
output head (``lm_head_std`` 0.05: logits of std ~1, where sampling at temperature 1 is really random; the tests'
models have std ~30, where any temperature vLLM allows (<= 2) samples the greedy token).
Prints per parameter: cases, first token equal, every token equal, the mean equal prefix, and the baseline's
every-token share; then a JSON line.

A migrated seeded request (issue 41): the worker that continues it gets the prompt plus the tokens already output
and skips as many draws of the request's seeded stream (``vllm_xargs.pdserve_rng_skip``, pdserve/vllm/rng_skip.py).
Per parameter, ``continued`` is the share of cases where one worker, continuing after ``--continue-at`` tokens that
way, gives exactly the tokens it gave after them in one go; ``restarted`` is the same without the skip (the old
behaviour, the baseline in the same run). ``--kv-connector nixl`` (or ``mooncake``) runs the launch on that data
plane, whose workers load no pdserve connector: the skip is installed there by vLLM's plugin entry point
(``PDSERVE_RNG_SKIP``, set by the launcher for every worker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from typing import Any

from pdserve.bench.traces import shared_prefix_len
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig

PARAMS: dict[str, dict[str, Any]] = {
    "temperature": {}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 20}, "min_p": {"min_p": 0.05},
    "presence_penalty": {"presence_penalty": 1.0}, "frequency_penalty": {"frequency_penalty": 1.0},
    "repetition_penalty": {"repetition_penalty": 1.2},
}


def _choice(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]


def _tokens(url: str, body: dict[str, Any]) -> list[int]:
    return list(_choice(url, body)["token_ids"])


def _continued(url: str, body: dict[str, Any], ref: dict[str, Any], k: int, skip: bool) -> bool:
    """One worker continuing after ``k`` of its own tokens (prompt + those tokens, the rest of the budget), with
    or without the skip: the tokens it gave after them in one go?"""
    more = {**body, "prompt": list(ref["prompt_token_ids"]) + list(ref["token_ids"][:k]),
            "max_tokens": body["max_tokens"] - k}
    if skip:
        more["vllm_xargs"] = {"pdserve_rng_skip": k}
    return _tokens(url, more) == list(ref["token_ids"][k:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model folder (default: a small random Llama, built once)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--continue-at", type=int, default=5, help="tokens output before the continued request")
    ap.add_argument("--kv-connector", default="pdserve", choices=("pdserve", "nixl", "mooncake"),
                    help="the launch's data plane")
    args = ap.parse_args()
    model = args.model
    if not model:
        from pdserve.launch.models import build_random_llama

        model = str(build_random_llama(os.path.join(".pdserve", "models", "random-llama-flat"), lm_head_std=0.05))
    cfg = LauncherConfig(model=model, prefill=1, decode=1, port=0, dtype="float32", max_model_len=2048,
                         served_model_name="m", worker_timeout_s=600, pool=False, kv_connector=args.kv_connector)
    rows: dict[str, dict[str, float]] = {}
    with Cluster(cfg, log=lambda s: print(f"[seeded] {s}", file=sys.stderr, flush=True)) as cluster:
        one = cluster.worker_urls("decode")[0]
        for name, extra in PARAMS.items():
            first = whole = same = continued = restarted = 0
            prefix = 0
            for seed in range(args.seeds):
                body = {"model": "m", "prompt": f"Case {seed}: once upon a time", "max_tokens": args.tokens,
                        "temperature": args.temperature, "seed": 1000 + seed, "ignore_eos": True,
                        "return_token_ids": True, **extra}
                ref_choice = _choice(one, body)
                ref = list(ref_choice["token_ids"])
                again = _tokens(one, body)
                continued += _continued(one, body, ref_choice, args.continue_at, True)
                restarted += _continued(one, body, ref_choice, args.continue_at, False)
                pd = _tokens(cluster.router_url, body)
                first += pd[:1] == ref[:1]
                whole += pd == ref
                same += again == ref
                prefix += shared_prefix_len(pd, ref)
            n = args.seeds
            rows[name] = {"cases": n, "first_equal": round(first / n, 3), "all_equal": round(whole / n, 3),
                          "mean_equal_prefix": round(prefix / n, 2), "one_worker_repeat_equal": round(same / n, 3),
                          "continued": round(continued / n, 3), "restarted": round(restarted / n, 3)}
    print(f"{'parameter':<20}{'cases':>6}{'first equal':>13}{'all equal':>11}{'equal prefix':>14}"
          f"{'1 worker x2':>13}{'continued':>11}{'restarted':>11}")
    for name, r in rows.items():
        print(f"{name:<20}{r['cases']:>6}{r['first_equal']:>13}{r['all_equal']:>11}{r['mean_equal_prefix']:>14}"
              f"{r['one_worker_repeat_equal']:>13}{r['continued']:>11}{r['restarted']:>11}")
    print(json.dumps({"bench": "seeded_sampling", "kv_connector": args.kv_connector, "tokens": args.tokens,
                      "temperature": args.temperature,
                      "continue_at": args.continue_at, "rows": rows}))


if __name__ == "__main__":
    main()
