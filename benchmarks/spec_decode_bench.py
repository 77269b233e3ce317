"""Speculative decoding on D (issue 36, item 4): drafting on the decode worker, its acceptance rate and TPOT
against the same 1P1D stack without it, and exactness against one worker with the same speculative config.

    PYTHONPATH=$PWD python benchmarks/spec_decode_bench.py [--method ngram] [--requests 8] [--rounds 2]
        [--output 64] [--model DIR]

Three stacks through the launcher on the same two cores, one after the other (three at once do not fit a 24 GiB
machine shared with other work): ``spec`` (1P1D with ``--speculative-config``), ``plain`` (1P1D without it) and
``one`` (one colocated worker with the same config, the reference).

- ``--method ngram`` (default; the launcher gives D only the config): SmolLM2-135M-Instruct in fp32 (a real model:
  a random one's output rarely repeats the prompt, so ngram drafts would not be accepted); prompts ask it to copy a
  passage it has begun to copy, where prompt-lookup drafting pays.
- ``--method draft_model|eagle|eagle3|mtp`` (drafters with layers: P gets the config too and computes the drafter's
  KV, which D reads with the target's): the tiny random target and drafter of
  :func:`pdserve.launch.models_drafters.drafter_stack`, which mirrors its target but for ``eagle3``, so acceptance
  measures whether the drafter's KV D holds is the one it would have computed; prompts of random token ids
  (300-600).

Per stack: TPOT per request (first streamed token -> last, over the tokens after the first; median), and for
``spec`` and ``one`` the deciding worker's acceptance from its ``/metrics`` (vLLM's ``spec_decode`` counters:
accepted over drafted tokens, and the mean tokens per verification step). Exactness: every prompt's greedy token
ids through ``spec`` equal ``one``'s, and (printed, not required: drafting may change fp32 rounding) ``plain``'s.
Prints a table and one JSON line; exits 1 when ``spec`` and ``one`` differ.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
WORDS = ("river stone lantern orchard copper meadow harbor violet ember canyon silver thistle garden falcon "
         "marble willow summit cedar quartz meadowlark beacon juniper glacier saffron").split()


def token_prompts(n: int, seed: int = 36) -> list[list[int]]:
    """Random token ids, 300-600 each (the random models' prompts)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randrange(300, 600))] for _ in range(n)]


def prompts(n: int, seed: int = 36) -> list[str]:
    """Copy tasks: a passage, then its copy begun, so the continuation repeats the prompt's n-grams."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        passage = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(60, 120)))
        half = " ".join(passage.split()[:rng.randrange(5, 15)])
        out.append(f"Copy the passage exactly.\nPassage: {passage}\nCopy: {half}")
    return out


def complete(url: str, prompt: str | list[int], output: int) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def tpot_ms(url: str, prompt: str | list[int], output: int) -> float:
    """One streamed request's TPOT: first content event -> last, over the completion tokens after the first."""
    body = {"model": "m", "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    first = last = 0.0
    tokens = 0
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c.get("text") or c.get("token_ids") for c in event.get("choices") or ()):
                last = time.perf_counter()
                first = first or last
    return (last - first) * 1e3 / max(tokens - 1, 1)


def spec_counters(url: str) -> dict[str, float]:
    """D's vLLM spec_decode counters (summed over label sets)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        key = f"vllm:spec_decode_{name}_total"
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(key) and not line.startswith("#"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft_model", "eagle", "eagle3", "mtp"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--model", default="", help="ngram's model folder (default: SmolLM2-135M-Instruct in fp32)")
    args = ap.parse_args()
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig

    work = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    model, spec, worker_args, texts = setup(args, work)
    shapes = {"spec": dict(prefill=1, decode=1, speculative_config=spec), "plain": dict(prefill=1, decode=1),
              "one": dict(colocated=1, speculative_config=spec)}
    tpots: dict[str, list[float]] = {}
    ids: dict[str, list[list[int]]] = {}
    judged: dict[str, dict[str, float]] = {}
    for name, shape in shapes.items():  # one stack at a time: three at once do not fit a 24 GiB shared machine
        cfg = LauncherConfig(model=str(model), port=0, dtype="float32", max_model_len=2048, served_model_name="m",
                             run_dir=str(work / name), worker_timeout_s=900, worker_args=worker_args,
                             pool=False if "colocated" not in shape else None, **shape)
        with Cluster(cfg) as c:
            url = c.router_url
            ids[name] = [complete(url, p, args.output) for p in texts]
            decider = [w.url for w in c.workers if w.name.startswith(("decode", "colocated"))][0]
            before = spec_counters(decider)
            tpots[name] = [tpot_ms(url, p, args.output) for _ in range(args.rounds) for p in texts]
            after = spec_counters(decider)
            judged[name] = {k: after[k] - before[k] for k in after}
    return report(args, spec, tpots, ids, judged)


def setup(args: argparse.Namespace, work: Path) -> tuple[Path, str, tuple[str, ...], list]:
    """The model, the speculative config, the workers' extra vLLM arguments and the prompts for ``--method``."""
    if args.method == "ngram":
        from pdserve.launch.config import default_model_dir
        from pdserve.launch.models import convert_smollm2

        model = Path(args.model) if args.model else convert_smollm2(default_model_dir().parent / "smollm2-fp32",
                                                                   dtype="float32")
        return model, json.dumps(NGRAM), (), prompts(args.requests)
    from pdserve.launch.models_drafters import drafter_stack

    model, spec, worker_args = drafter_stack(args.method, work / "models")
    return model, json.dumps(spec), worker_args, token_prompts(args.requests)


def acceptance(judged: dict[str, float]) -> tuple[float, float]:
    """Accepted over drafted tokens, and tokens per verification step."""
    accept = judged["num_accepted_tokens"] / judged["num_draft_tokens"] if judged["num_draft_tokens"] else 0.0
    per_step = 1 + judged["num_accepted_tokens"] / judged["num_drafts"] if judged["num_drafts"] else 1.0
    return accept, per_step


def report(args: argparse.Namespace, spec: str, tpots: dict[str, list[float]], ids: dict[str, list[list[int]]],
           judged: dict[str, dict[str, float]]) -> int:
    med = {k: statistics.median(v) for k, v in tpots.items()}
    exact = ids["spec"] == ids["one"]
    same_as_plain = sum(a == b for a, b in zip(ids["spec"], ids["plain"], strict=True))
    (accept, per_step), (accept_one, per_step_one) = acceptance(judged["spec"]), acceptance(judged["one"])
    drafter = "random drafter" if args.method == "eagle3" else "mirror drafter"
    what = "SmolLM2-135M fp32, copy prompts" if args.method == "ngram" else f"{drafter}, random-token prompts"
    print(f"{args.method}: {what}; {args.requests} prompts x {args.rounds} rounds, {args.output} tokens each; {spec}")
    print(f"{'stack':6} {'TPOT ms (median)':>17} {'x plain':>8} {'acceptance':>11} {'tokens/step':>12}")
    for k in tpots:
        acc = {"spec": f"{accept:.3f}", "one": f"{accept_one:.3f}"}.get(k, "-")
        step = {"spec": f"{per_step:.2f}", "one": f"{per_step_one:.2f}"}.get(k, "-")
        print(f"{k:6} {med[k]:>17.2f} {med[k] / med['plain']:>8.3f} {acc:>11} {step:>12}")
    d = judged["spec"]
    print(f"D: {d['num_accepted_tokens']:.0f} of {d['num_draft_tokens']:.0f} drafted tokens accepted; one worker: "
          f"{judged['one']['num_accepted_tokens']:.0f} of {judged['one']['num_draft_tokens']:.0f}; spec == one: "
          f"{exact}; spec == plain on {same_as_plain} of {len(ids['spec'])} prompts")
    print(json.dumps({"method": args.method, "requests": args.requests, "rounds": args.rounds, "output": args.output,
                      "tpot_ms_spec": round(med["spec"], 3), "tpot_ms_plain": round(med["plain"], 3),
                      "tpot_ms_one": round(med["one"], 3),
                      "tpot_ratio_spec_over_plain": round(med["spec"] / med["plain"], 3),
                      "acceptance": round(accept, 4), "tokens_per_step": round(per_step, 3),
                      "acceptance_one": round(accept_one, 4), "tokens_per_step_one": round(per_step_one, 3),
                      "accepted_d": d["num_accepted_tokens"], "accepted_one": judged["one"]["num_accepted_tokens"],
                      "spec_equals_one": exact, "spec_equals_plain_prompts": same_as_plain}))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
