"""Coverage matrix of the model families (issue 36): family x data plane x pool, each cell a real 1P1D stack
(``pdserve serve`` through the launcher: router, P and D vLLM CPU workers) on a tiny random model of the family
(the hybrid KV cache families of ``pdserve.launch.model_families`` by default; ``llama``, ``qwen3moe`` and
``deepseekv3`` too: :data:`ROWS`), greedy, prompts that share a prefix, compared token for token with P serving
the whole request alone.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/hybrid_matrix.py [--families gemma3,gptoss,qwen3next,granitehybrid]
        [--planes pdserve,pdserve+pool,nixl,nixl+store,mooncake,mooncake+store] [--tp N] [--json-out FILE]

Planes: ``pdserve`` (pdserve's connector, no pool), ``pdserve+pool`` (with the KV pool, pdserve/vllm/pool_groups.py;
the cell also takes a pool hit: P serves a fresh 740-token prompt, then its first 640 tokens alone (a block
boundary for every family: the state after exactly 640 tokens, the window block before it), and D, sent the
740-token prompt alone, loads the pooled 640 tokens: its pool-loaded-token counter and its answer against P's first
one), ``nixl+store`` / ``mooncake+store`` (vLLM's NixlConnector / MooncakeConnector with Mooncake Store as
the pool, ``--pool-backend mooncake``: vLLM's MooncakeStoreConnector beside it in MultiConnector; the same pool
hit, D's load counted as vLLM's external-KV prompt tokens), ``nixl`` / ``mooncake`` (vLLM's own
NixlConnector / MooncakeConnector, ``--kv-connector``). Each cell says: exact answers / prompts (and which prompts
differ), "refused at start-up" where ``pdserve serve`` refuses the combination (pdserve/launch/plane_limits.py), or
why the stack did not serve (the workers' last error line), whether vLLM kept its hybrid KV cache manager on, and
for pdserve's connector the KV bytes D read per prompt token it took from P. Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.prom import scrape
from pdserve.launch import Cluster
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.launch.model_families import FAMILIES, build_family
from pdserve.launch.models import build_random_llama
from pdserve.launch.models_mla import build_random_deepseek_v3
from pdserve.launch.models_moe import build_random_qwen3_moe
from pdserve.plan.kvsize import handoff_bytes, load_model


@dataclass(frozen=True)
class Row:
    """One row of the matrix: a model family, how to build its tiny random model, what to serve it with."""

    kind: str
    dtype: str
    build: Callable[[Path], Path]
    worker_args: tuple[str, ...] = ()


def _family_row(name: str) -> Row:
    spec = FAMILIES[name]
    return Row(spec.kind, spec.dtype, lambda out: build_family(name, out), spec.worker_args)


# the hybrid KV cache families (pdserve.launch.model_families), and the single-group families beside them: dense,
# MoE, and MLA (DeepSeek-V3's shape; vLLM's reference CPU MLA backend: on AMX hosts vLLM would pick one that takes
# bf16 only, as tests/integration/test_mla_vllm.py says)
ROWS: dict[str, Row] = {
    "llama": Row("dense, one group", "float32", lambda out: build_random_llama(out)),
    "qwen3moe": Row("MoE, one group", "float32", lambda out: build_random_qwen3_moe(out)),
    "deepseekv3": Row("MLA + MoE, one group", "float32", lambda out: build_random_deepseek_v3(out),
                      ("--attention-backend", "CPU_MLA")),
    **{name: _family_row(name) for name in FAMILIES},
}
HYBRID = tuple(FAMILIES)  # the default rows

PLANES = ("pdserve", "pdserve+pool", "nixl", "nixl+store", "mooncake", "mooncake+store")
POOLS = ("+pool", "+store")  # pdserve's KV pool; Mooncake Store (--pool-backend mooncake)
GEN = 8
FRESH = (0, 3)  # the prompts D has no prefix of: their hand-off bytes are compared with pdserve plan's
HMA_OFF = "Turning off hybrid kv cache manager"


def prompts() -> list[list[int]]:
    """Three prompts sharing a 300-token prefix, one fresh: past the sliding window (128 tokens) and a block."""
    rnd = random.Random(36)
    prefix = [rnd.randrange(1000, 40000) for _ in range(300)]
    out = [prefix + [rnd.randrange(1000, 40000) for _ in range(n)] for n in (20, 200, 700)]
    return out + [[rnd.randrange(1000, 40000) for _ in range(150)]]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def read_bytes(url: str) -> float:
    return scrape(url, "vllm:pdserve_kv_read_bytes").get("vllm:pdserve_kv_read_bytes_total", 0.0)


def last_error(run_dir: Path) -> str:
    """The last line of the workers' logs that names an error before the stack was stopped (why a stack did not
    come up or a request failed; what follows the launcher's SIGTERM is the stop's own noise). Mooncake's glog
    error lines (``E1204 ...``) count too."""
    found = ""
    for log in sorted(run_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "[shutdown]" in line:
                break
            if (re.search(r"(Error|error:|Exception)\b", line) or re.match(r"E\d{4} ", line)) and "ulimit" not in line:
                found = f"{log.stem}: {line.strip()[-160:]}"
    return found


def worker_block_size(run_dir: Path) -> int:
    """The block size of P's single-group KV cache (pdserve's connector logs its layout, e.g. ``float32/bs16/L3``),
    else 128. vLLM's CPU MLA backend keeps 16-token blocks; a hand-off moves whole blocks."""
    log = run_dir / "prefill0.log"
    found = re.search(r"/bs(\d+)/L\d+", log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1)) if found else 128


def counter(url: str, name: str) -> float:
    return scrape(url, name).get(name + "_total", 0.0)


def store_keys(c: Cluster) -> float:
    """How many objects Mooncake Store holds (its master's HTTP metrics server)."""
    with urllib.request.urlopen(c.plan.pool.metrics_url + "/get_all_keys", timeout=10) as resp:
        return float(sum(1 for k in resp.read().decode().splitlines() if k))


def external_tokens(url: str) -> float:
    """Prompt tokens a worker took from a KV connector (vLLM's own count: the pool or store, or P)."""
    return sum(v for k, v in scrape(url, "vllm:prompt_tokens_by_source_total", labels=True).items()
               if 'source="external_kv_transfer"' in k)


def pool_probe(cell: dict[str, Any], c: Cluster, plane: str) -> None:
    """A pool hit on D (the module docstring): ``pool_loaded`` tokens D took from the pool (pdserve's pool: its
    connector's counter; Mooncake Store: vLLM's external-KV prompt tokens, D being sent no kv_transfer_params),
    ``pool_exact``."""
    p_url, d_url = c.worker_urls("prefill")[0], c.worker_urls("decode")[0]
    if plane.endswith("+store"):
        def saved() -> float:
            return store_keys(c)

        def loaded() -> float:
            return external_tokens(d_url)
    else:
        def saved() -> float:
            return counter(p_url, "vllm:pdserve_kv_pool_saved_blocks")

        def loaded() -> float:
            return counter(d_url, "vllm:pdserve_kv_pool_loaded_tokens")
    rnd = random.Random(3637)
    longer = [rnd.randrange(1000, 40000) for _ in range(740)]
    body = {"model": "m", "max_tokens": GEN, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    ref = post(p_url + "/v1/completions", {**body, "prompt": longer})["choices"][0]["token_ids"]
    before = saved()
    post(p_url + "/v1/completions", {**body, "prompt": longer[:640], "max_tokens": 1})
    deadline = time.monotonic() + 30  # P saves after the request ends; vLLM publishes the counter periodically
    while saved() <= before and time.monotonic() < deadline:
        time.sleep(0.5)
    cell["pool_saved"] = int(saved() - before)
    start = loaded()
    out = post(d_url + "/v1/completions", {**body, "prompt": longer})["choices"][0]["token_ids"]
    deadline = time.monotonic() + 30
    while loaded() <= start and time.monotonic() < deadline:
        time.sleep(0.5)
    cell["pool_loaded"] = int(loaded() - start)
    cell["pool_exact"] = out == ref


def run_cell(family: str, plane: str, root: Path, tp: int = 1, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    spec = ROWS[family]
    model = spec.build(root / "models" / family)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{family}-{plane}-", dir=root))
    cell: dict[str, Any] = {"family": family, "plane": plane, "tp": tp, "prompts": 0, "exact": 0}
    t0 = time.monotonic()
    try:
        cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype=spec.dtype, max_model_len=2048,
                             served_model_name="m", run_dir=str(run_dir), worker_timeout_s=600, restart=False,
                             pool=plane.endswith(POOLS), kv_connector=plane.split("+")[0], lease_s=30,
                             pool_backend="mooncake" if plane.endswith("+store") else "pdserve",
                             worker_args=spec.worker_args + extra, prefill_tp=tp, decode_tp=tp)
        with Cluster(cfg) as c:
            p_url, d_url = c.worker_urls("prefill")[0], c.worker_urls("decode")[0]
            moved, tokens, predicted = 0.0, 0, 0.0
            plan = load_model(str(model))
            for i, prompt in enumerate(prompts()):
                body = {"model": "m", "prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}
                before = read_bytes(d_url) if plane.startswith("pdserve") else 0.0
                out = post(c.router_url + "/v1/completions", body)
                if plane.startswith("pdserve") and i in FRESH:  # D's own prefix cache holds none of it
                    moved += read_bytes(d_url) - before
                    tokens += len(prompt)
                    bs = 128 if family in HYBRID else worker_block_size(run_dir)  # (HMA sizes its own pages)
                    predicted += handoff_bytes(plan, len(prompt), "bf16" if spec.dtype == "bfloat16" else "fp32", bs)
                ref = post(p_url + "/v1/completions", body)
                cell["prompts"] += 1
                same = out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
                cell["exact"] += same
                if not same:  # which prompts differ (index into prompts(), length)
                    cell.setdefault("differ", []).append([i, len(prompt)])
            if plane.endswith(POOLS):
                pool_probe(cell, c, plane)
            if tokens:
                cell["wire_bytes_per_token"] = round(moved / tokens, 1)
                cell["plan_bytes_per_token"] = round(predicted / tokens, 1)
    except ConfigError as exc:  # the launch refuses the combination before starting anything
        cell["refused"] = str(exc)
    except Exception as exc:
        cell["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == __file__]
        if frames:  # where in this bench it was raised (a start-up, a request, a pool probe)
            cell["where"] = f"{frames[-1].name}:{frames[-1].lineno}"
        cell["cause"] = last_error(run_dir)
    logs = "".join(p.read_text(errors="replace") for p in run_dir.glob("*0.log"))
    cell["hma"] = "off" if HMA_OFF in logs else "on"
    cell["pool_off"] = "KV pool off on this worker" in logs
    cell["seconds"] = round(time.monotonic() - t0, 1)
    return cell


def verdict(cell: dict[str, Any]) -> str:
    if "refused" in cell:
        return "refused at start-up (" + ("one-token-short hand-off of a state model in half precision"
                                          if "one token short" in cell["refused"] else cell["refused"][:80]) + ")"
    if "error" in cell:
        return f"dies ({cell.get('cause') or cell['error']})"[:90]
    text = f"{cell['exact']}/{cell['prompts']} exact, HMA {cell['hma']}"
    if cell.get("differ"):
        text += " (differ: " + ", ".join(f"{n}-token prompt" for _, n in cell["differ"]) + ")"
    if cell.get("pool_off"):
        text += ", pool off"
    if "pool_loaded" in cell:
        text += (f", pool hit {cell['pool_loaded']} tokens " + ("exact" if cell["pool_exact"] else "DIFFERS")
                 if cell["pool_loaded"] else ", no pool hit (" + ("exact" if cell["pool_exact"] else "DIFFERS") + ")")
    if cell.get("wire_bytes_per_token"):
        text += f", {cell['wire_bytes_per_token']:.0f} B/token (plan {cell['plan_bytes_per_token']:.0f})"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(HYBRID), help=f"rows, of {', '.join(ROWS)} (default: the "
                    "hybrid families)")
    ap.add_argument("--planes", default=",".join(PLANES))
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of P and D alike (pdserve+pool "
                    "needs 1: the pool is TP=1 only)")
    ap.add_argument("--worker-args", default="", help="more vLLM arguments for every worker of every cell (one "
                    "string, split as a shell would)")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    planes = [p for p in args.planes.split(",") if p]
    unknown = sorted(set(families) - set(ROWS)) + sorted(set(planes) - set(PLANES))
    if unknown:
        ap.error(f"unknown family or plane {unknown}: families {sorted(ROWS)}, planes {list(PLANES)}")
    root = Path(tempfile.mkdtemp(prefix="hybrid-matrix-"))
    cells = []
    for family in families:
        for plane in planes:
            cell = run_cell(family, plane, root, args.tp, tuple(shlex.split(args.worker_args)))
            cells.append(cell)
            print(f"# {family} x {plane}: {verdict(cell)} ({cell['seconds']} s)", file=sys.stderr, flush=True)
    tp = f", P TP={args.tp} -> D TP={args.tp}" if args.tp > 1 else ""
    print(f"| family (KV cache groups{tp}) | " + " | ".join(planes) + " |")
    print("|---|" + "---|" * len(planes))
    for family in families:
        row = [verdict(c) for p in planes for c in cells if c["family"] == family and c["plane"] == p]
        print(f"| {family} ({ROWS[family].kind}, {ROWS[family].dtype}) | " + " | ".join(row) + " |")
    result = {"bench": "hybrid_matrix", "cells": cells}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if all("error" not in c and c["exact"] == c["prompts"] and c.get("pool_exact", True)
                    for c in cells) else 1  # refused cells pass


if __name__ == "__main__":
    sys.exit(main())
