"""Issue 39's measure: prefill tokens computed, pool hits by tier and TTFT p50/p99 with tier-aware placement
(``--tier-pricing priced``, the default) against placement that counts only device hits (``device``) and, when
asked, placement as it was before tiers (``flat``), on the conversation trace with pdserve's KV pool, in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tier_placement_bench.py [--requests 40] [--rate 1.0]
        [--configs priced,flat,device] [--pool-mem 24MiB] [--pool-disk 1GiB]

One launch: 2 prefill workers and 1 decode worker (a small random Llama in fp32, pdserve's connector), the KV pool
(a master and a node with ``--pool-mem`` of memory and ``--pool-disk`` of SSD tier, so older prefixes spill to
disk), and one extra router per config on the same workers and pool (``--policy conductor --local-prefill-tokens 0
--tier-pricing CONFIG``: every request goes P -> D, so the prefill worker the conductor picks is where the prompt
is computed). The trace (pdserve/bench/data: the Mooncake conversation trace) is shortened to fit ~10 minutes on
2 cores: ``--requests`` rows chosen by :func:`pdserve.bench.traces.conversation_rows` (later turns together with
the turn they extend, so prefixes recur as in the whole trace), prompts x0.1 up to 1,500 tokens, outputs x0.25 up
to 16 tokens, replayed at ``--rate`` requests/s.

Fair by construction: the configs replay the same requests (the same token ids) in two passes, and before each
pass every worker's prefix cache is emptied (vLLM's ``/reset_prefix_cache``; the workers run with
``VLLM_SERVER_DEV_MODE=1``, the reset's ``AllBlocksCleared`` empties every router's index) and every pooled object
is removed, so each pass starts from the same empty caches. The machine's load may still differ between the passes
(``uptime`` before and after each is printed); run with ``--configs device,priced`` to swap the order.

Per config: what the placements expected (their decision records: decisions per tier they meant to load from,
the tokens they expected to load or find cached), the prompt tokens the prefill workers computed (vLLM's
``prompt_tokens_by_source{source="local_compute"}``) and took from their own prefix cache or the pool
(``local_cache_hit``, ``external_kv_transfer``), the pool master's hits (objects) from memory and from disk, TTFT
p50 / p99 at the client. Prints a table and one JSON line with the ratios
against the first config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.bench.traces import conversation_rows, cpu_scale, load_trace, prompt_ids, scale_rows
from pdserve.launch import Cluster
from pdserve.launch.config import LauncherConfig
from pdserve.launch.models import model_or_random_llama
from pdserve.launch.ports import free_port
from pdserve.launch.procs import Child, spawn_healthy, stop_children
from pdserve.store.client import StoreClient
from pdserve.store.config import ClientConfig

VOCAB = 32000
POOL_KEYS = ("hits_mem", "hits_ssd", "misses", "spills", "promotes", "puts")


def _load() -> str:
    return os.getloadavg().__repr__()


async def _one(session: aiohttp.ClientSession, url: str, ids: list[int], out: int) -> tuple[float, str]:
    """TTFT (s) of one streamed request (nan when it fails) and its X-Request-Id."""
    body = {"model": "m", "prompt": ids, "max_tokens": out, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = float("nan")
    async with session.post(url + "/v1/completions", json=body) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if first != first and line.startswith("data:") and line != "data: [DONE]" and '"error"' not in line:
                first = time.perf_counter() - t0
    return (first if r.status == 200 else float("nan")), r.headers.get("X-Request-Id", "")


async def _decided(url: str, ids: list[str]) -> dict[str, Any]:
    """What the placements expected to load, from their decision records: decisions per fetch tier and the
    prompt tokens they expected to load (``fetch_tokens``) or to find cached (``cached_tokens``)."""
    tiers: dict[str, int] = {}
    fetch = cached = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for rid in ids:
            async with s.get(f"{url}/v1/pdserve/decisions/{rid}") as r:
                if r.status != 200:
                    continue
                rec = await r.json()
            for p in rec.get("placements", [])[:1]:
                hit = p.get("prefix_hit") or {}
                tier = hit.get("fetch_tier") or "none"
                tiers[tier] = tiers.get(tier, 0) + 1
                fetch += int(hit.get("fetch_tokens") or 0)
                cached += int(hit.get("cached_tokens") or 0)
    return {"decided_fetch_tier": tiers, "decided_fetch_tokens": fetch, "decided_cached_tokens": cached}


async def _pass(url: str, prompts: list[tuple[float, list[int], int]]) -> list[tuple[float, str]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.monotonic()

        async def go(arrival: float, ids: list[int], out: int) -> tuple[float, str]:
            await asyncio.sleep(max(0.0, arrival - (time.monotonic() - t0)))
            return await _one(s, url, ids, out)

        return list(await asyncio.gather(*(go(*p) for p in prompts)))


def _scrape(urls: list[str]) -> dict[str, float]:
    """Prompt tokens by source, summed over ``urls``' /metrics."""
    out: dict[str, float] = {}
    for u in urls:
        with urllib.request.urlopen(u + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:prompt_tokens_by_source") and 'source="' in line:
                    key = line.split('source="')[1].split('"')[0]
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _reset(workers: list[str], pool: StoreClient) -> None:
    """Empty every worker's prefix cache and the pool (retried while blocks are still held)."""
    for u in workers:
        for _ in range(30):
            req = urllib.request.Request(u + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                if json.loads(r.read() or b"{}").get("success", True):
                    break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"{u}: prefix cache reset refused for 30 s")
    for _ in range(10):
        keys = pool.keys()
        if not keys:
            return
        pool.remove(keys)
        time.sleep(1.0)
    raise RuntimeError(f"pool still holds {len(pool.keys())} objects after 10 removals")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else float("nan")


def _run(name: str, url: str, prefill: list[str], workers: list[str], pool: StoreClient,
         prompts: list[tuple[float, list[int], int]]) -> dict[str, Any]:
    _reset(workers, pool)
    time.sleep(2.0)  # the resets' AllBlocksCleared and the pool's removals reach the routers
    load0 = _load()
    before, pool0 = _scrape(prefill), pool.stats()
    t0 = time.monotonic()
    answers = asyncio.run(_pass(url, prompts))
    wall = time.monotonic() - t0
    time.sleep(6.0)  # vLLM publishes its counters with its periodic stats
    after, pool1 = _scrape(prefill), pool.stats()
    decided = asyncio.run(_decided(url, [rid for _, rid in answers if rid]))
    ttfts = [t for t, _ in answers]
    ok = [t for t in ttfts if t == t]
    src = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    row = {"ok": len(ok), "of": len(ttfts), "wall_s": round(wall, 1),
           "computed_tokens": src.get("local_compute", 0.0), "device_hit_tokens": src.get("local_cache_hit", 0.0),
           "loaded_tokens": src.get("external_kv_transfer", 0.0),
           **{f"pool_{k}": pool1.get(k, 0) - pool0.get(k, 0) for k in POOL_KEYS},
           "ttft_p50_ms": round(1e3 * statistics.median(ok), 1) if ok else None,
           "ttft_p99_ms": round(1e3 * _pct(ok, 99), 1) if ok else None, **decided, "load_before": load0,
           "load_after": _load()}
    print(f"[tiers] {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def _router(name: str, argv: tuple[str, ...], pricing: str, secret: str, log_dir: Path) -> tuple[Child, str]:
    """One more router on the launch's workers and pool, its placement priced as ``pricing``."""
    base = list(argv)
    for flag in ("--port", "--membership-file"):  # its own port; membership from argv (no shared file)
        if flag in base:
            i = base.index(flag)
            del base[i:i + 2]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = spawn_healthy(f"router-{pricing}", [*base, "--port", str(port), "--local-prefill-tokens", "0",
                                                  "--tier-pricing", pricing], url, 300,
                          env={**os.environ, "PDSERVE_TRANSFER_SECRET": secret}, log_path=log_dir / f"{name}.log")
    return child, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="model folder (default: a random 2-layer Llama, fp32)")
    ap.add_argument("--requests", type=int, default=40, help="trace requests per pass")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--configs", default="priced,flat,device", help="tier pricings, in pass order")
    ap.add_argument("--pool-mem", default="24MiB", help="the pool node's memory tier (small: prefixes spill)")
    ap.add_argument("--pool-disk", default="1GiB", help="the pool node's SSD tier")
    ap.add_argument("--start", type=int, default=0, help="first trace row")
    a = ap.parse_args()
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="tier-bench-"))
    model = model_or_random_llama(a.model, tmp)
    scale = cpu_scale(a.rate, max_output=16)
    reqs = scale_rows(conversation_rows(load_trace(start=a.start), a.requests, 0.32), scale)
    prompts = [(r.arrival_s, prompt_ids(r, scale.block_tokens, VOCAB, 1), r.output_length) for r in reqs]
    print(f"[tiers] {len(prompts)} requests, {sum(len(p[1]) for p in prompts)} prompt tokens, arrivals over "
          f"{reqs[-1].arrival_s:.0f} s; load {_load()}", file=sys.stderr, flush=True)
    cfg = LauncherConfig(model=model, prefill=2, decode=1, policy="conductor", port=0, dtype="float32",
                         max_model_len=4096, served_model_name="m", pool=True, pool_mem=a.pool_mem,
                         pool_disk=a.pool_disk, env={"VLLM_SERVER_DEV_MODE": "1"}, worker_timeout_s=600,
                         run_dir=str(tmp / "run"))
    rows: dict[str, dict[str, Any]] = {}
    routers: list[Child] = []
    with Cluster(cfg) as c:
        assert c.plan is not None and c.plan.pool is not None
        pool = StoreClient(ClientConfig("127.0.0.1", c.plan.pool.port, secret=c.secret))
        try:
            urls = {}
            for name in configs:
                child, urls[name] = _router(name, c.plan.router_argv, name, c.secret, tmp)
                routers.append(child)
            for name in configs:
                rows[name] = _run(name, urls[name], c.worker_urls("prefill"), c.worker_urls(), pool, prompts)
        finally:
            stop_children(routers, timeout_s=20)
    cols = ("ok", "computed_tokens", "device_hit_tokens", "loaded_tokens", "pool_hits_mem", "pool_hits_ssd",
            "pool_spills", "ttft_p50_ms", "ttft_p99_ms")
    print(f"{'pricing':8}" + "".join(f"{k:>18}" for k in cols))
    for name, r in rows.items():
        print(f"{name:8}" + "".join(f"{r[k] if r[k] is not None else '-':>18}" for k in cols))
    base = rows[configs[0]]

    def ratio(r: dict, k: str) -> float | None:
        return round(r[k] / base[k], 3) if r.get(k) and base.get(k) else None

    out = {"bench": "tier_placement", "requests": len(prompts), "rate": a.rate, "pool_mem": a.pool_mem,
           "pool_disk": a.pool_disk, "rows": rows,
           "vs_" + configs[0]: {n: {k: ratio(r, k) for k in ("computed_tokens", "ttft_p50_ms", "ttft_p99_ms")}
                                for n, r in rows.items() if n != configs[0]}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
