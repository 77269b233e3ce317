"""Sliding-window hand-off (issue 36, items 1 and 6): with vLLM's hybrid KV cache manager on, pdserve's connector
moves only the blocks a sliding-window layer's next window reaches; with it off (the path before: every layer
keeps and moves the whole prompt) the bytes grow with the prompt on every layer.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/window_bench.py [--family gptoss] [--lengths 512,1920] [--reps 3]

Two real 1P1D stacks in one run (``pdserve serve`` through the launcher, on the same cores): one with the manager
on (the default now), one started with ``--disable-hybrid-kv-cache-manager`` (vLLM's flag: what pdserve's
connector made vLLM do before). They take the same prompts in turns (fresh random prompts: no prefix hits). Per
prompt length (gpt-oss's shape: window 128, half the layers sliding; 512 = 4x the window): the hand-off bytes D
read (its connector's counter), the hand-off time (D's read, from its ``hand-off`` log line), D's KV cache memory
while it decodes the request (``vllm:kv_cache_usage_perc`` at its peak x the worker's KV cache size), whether the
answer equals P's alone, and the ratios off / on. Medians over ``--reps`` prompts. Prints a table, then one JSON
line. Say the load you ran under (``uptime``): the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.bench.prom import scrape
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig
from pdserve.launch.model_families import FAMILIES, build_family

GEN = 48
KV_GIB = 1


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def metric(url: str, name: str) -> float:
    return scrape(url, name).get(name, 0.0)


def handoffs(log: Path) -> list[dict[str, Any]]:
    """D's connector's ``hand-off {json}`` lines (pdserve.vllm.stamps), in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "hand-off {" in line:
            out.append(json.loads(line[line.index("{"):]))
    return out


class Peak(threading.Thread):
    """Polls D's KV cache usage until stopped; keeps the peak."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.peak, self.stop = url, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, metric(self.url, "vllm:kv_cache_usage_perc"))
            except Exception:
                pass
            self.stop.wait(0.05)


def one(c: Cluster, prompt: list[int]) -> dict[str, Any]:
    p_url, d_url = c.worker_urls("prefill")[0], c.worker_urls("decode")[0]
    body = {"model": "m", "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    before = metric(d_url, "vllm:pdserve_kv_read_bytes_total")
    peak = Peak(d_url)
    peak.start()
    out = post(c.router_url + "/v1/completions", body)
    peak.stop.set()
    peak.join()
    moved = metric(d_url, "vllm:pdserve_kv_read_bytes_total") - before
    d_log = next(w.log_path for w in c.workers if w.name == "decode0")
    read_ms = handoffs(d_log)[-1].get("read_ms", 0.0)
    ref = post(p_url + "/v1/completions", body)
    return {"bytes": moved, "read_ms": read_ms, "d_kv_bytes": peak.peak * KV_GIB * 2 ** 30,
            "exact": out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]}


def median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="gptoss", choices=[f for f, s in FAMILIES.items() if s.sliding_window])
    ap.add_argument("--lengths", default="512,1920")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    spec = FAMILIES[args.family]
    lengths = [int(x) for x in args.lengths.split(",")]
    root = Path(tempfile.mkdtemp(prefix="window-bench-"))
    model = build_family(args.family, root / args.family)
    modes = {"hma_on": (), "hma_off": ("--disable-hybrid-kv-cache-manager",)}
    rnd = random.Random(7)
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    stacks = {}
    try:
        for mode, extra in modes.items():
            cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype=spec.dtype, max_model_len=2048,
                                 served_model_name="m", run_dir=str(root / mode), worker_timeout_s=600,
                                 restart=False, pool=False, kv_cache_gib=KV_GIB,
                                 worker_args=spec.worker_args + extra)
            stacks[mode] = Cluster(cfg).__enter__()
        for _ in range(args.reps):
            for n in lengths:
                prompt = [rnd.randrange(1000, 40000) for _ in range(n)]
                for mode, c in stacks.items():  # the same prompt on both, in turns
                    rows.setdefault((mode, n), []).append(one(c, prompt))
    finally:
        for c in stacks.values():
            c.__exit__(None, None, None)
    result: dict[str, Any] = {"bench": "window_bench", "family": args.family, "window": spec.sliding_window,
                              "reps": args.reps, "cells": []}
    print(f"{args.family} (window {spec.sliding_window} tokens), medians of {args.reps}; off/on = HMA off over on")
    print("| prompt tokens | mode | hand-off bytes | bytes/token | hand-off ms | D KV while decoding | exact |")
    print("|---|---|---|---|---|---|---|")
    for n in lengths:
        for mode in modes:
            r = rows[(mode, n)]
            cell = {"tokens": n, "mode": mode, "bytes": median(r, "bytes"), "read_ms": median(r, "read_ms"),
                    "d_kv_bytes": median(r, "d_kv_bytes"), "exact": sum(x["exact"] for x in r), "of": len(r)}
            result["cells"].append(cell)
            print(f"| {n} | {mode} | {cell['bytes']:.0f} | {cell['bytes'] / n:.0f} | {cell['read_ms']:.2f} | "
                  f"{cell['d_kv_bytes'] / 2 ** 20:.2f} MiB | {cell['exact']}/{cell['of']} |")
        on, off = (next(c for c in result["cells"] if c["tokens"] == n and c["mode"] == m) for m in modes)
        ratio = {k: round(off[k] / on[k], 2) if on[k] else None for k in ("bytes", "read_ms", "d_kv_bytes")}
        result.setdefault("off_over_on", {})[n] = ratio
        print(f"| {n} | off/on | {ratio['bytes']}x | | {ratio['read_ms']}x | {ratio['d_kv_bytes']}x | |")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
