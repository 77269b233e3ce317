"""What the router adds to one request at a time, with the worker's own cost taken out: TTFT, end-to-end time and
router CPU per request through this tree's router and through baseline trees' routers, in front of one fake
colocated worker (router_ceiling_bench.py's vLLM-shaped fake, a token every ``--token-ms``), so the figures move
only with the routers.

    python benchmarks/router_ttft_bench.py --baseline-root DIR [--baseline-root DIR2] [--requests 150] [--tokens 16]

Each ``--baseline-root`` is another pdserve source tree (e.g. ``git archive REV | tar -x -C DIR``). The requests
go one at a time, in rounds whose order rotates (each router first in turn), after 10 warm-up rounds; each
router's CPU (/proc/PID/task/*/schedstat) is read around each of its requests. Every router runs the same command
line (router_ceiling_bench's). Prints a table (p50s), the ratios this / each baseline (TTFT p50, CPU per request
p50, the median of paired TTFT differences) and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import router_ceiling_bench as rc

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 10


async def _one(port: int, tokens: int, k: int) -> tuple[float, float]:
    """(TTFT, end to end) seconds of one streamed completion through the router on ``port``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(rc._payload(port, tokens, k))
    await writer.drain()
    ttft, buf = None, b""
    while b"data: [DONE]" not in buf:
        data = await reader.read(65536)
        if not data:
            raise RuntimeError(f"router on {port} closed the stream early: {buf[-200:]!r}")
        buf += data
        if ttft is None and b"data: {" in buf:
            ttft = time.perf_counter() - t0
    writer.close()
    assert ttft is not None
    return ttft, time.perf_counter() - t0


async def _rounds(routers: list[tuple[str, subprocess.Popen, int]], n: int, tokens: int) -> dict[str, dict]:
    out: dict[str, dict[str, list[float]]] = {name: {"ttft": [], "e2e": [], "cpu": []} for name, _, _ in routers}
    for i in range(n + WARMUP):
        k = i % len(routers)
        for name, proc, port in routers[k:] + routers[:k]:
            c0 = rc._cpu_s(proc.pid)
            ttft, e2e = await _one(port, tokens, i)
            cpu = rc._cpu_s(proc.pid) - c0
            if i >= WARMUP:
                for key, v in (("ttft", ttft), ("e2e", e2e), ("cpu", cpu)):
                    out[name][key].append(v * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-root", action="append", default=[], help="another pdserve tree (repeatable)")
    ap.add_argument("--requests", type=int, default=150, help="measured requests per router")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request")
    ap.add_argument("--token-ms", type=float, default=1.0, help="the fake worker's time per token")
    a = ap.parse_args()
    trees = [("this", ROOT)] + [(f"baseline{i}", Path(p).resolve()) for i, p in enumerate(a.baseline_root)]
    tmp = Path(tempfile.mkdtemp(prefix="router-ttft-"))
    model = rc._write_model(tmp / "model")
    wport = rc._free_port()
    fake = subprocess.Popen([sys.executable, rc.__file__, "--fake-worker", str(wport), "--token-ms", str(a.token_ms),
                             "--tokens", str(a.tokens), "--stream-interval", "1"], start_new_session=True)
    routers: list[tuple[str, subprocess.Popen, int]] = []
    try:
        rc._wait_http(wport, "/health", 30, fake)
        for name, root in trees:
            proc, port = rc._start_router(root, model, {"colocated": [f"http://127.0.0.1:{wport}"]},
                                          tmp / f"router-{name}.log")
            routers.append((name, proc, port))
            rc._wait_http(port, "/health", 120, proc)
        res = asyncio.run(_rounds(routers, a.requests, a.tokens))
    finally:
        for _, proc, _ in routers:
            rc._stop(proc)
        rc._stop(fake)
    p50 = {n: {k: round(statistics.median(v), 4) for k, v in r.items()} for n, r in res.items()}
    print(f"one request at a time, {a.requests} per router, {a.tokens} tokens, fake worker {a.token_ms:g} ms/token")
    print(f"{'router':<12}{'root':<40}{'TTFT p50 ms':>14}{'e2e p50 ms':>14}{'CPU/request p50 ms':>20}")
    for name, root in trees:
        print(f"{name:<12}{str(root)[-39:]:<40}{p50[name]['ttft']:>14.3f}{p50[name]['e2e']:>14.3f}"
              f"{p50[name]['cpu']:>20.3f}")
    ratios = {}
    for name, _ in trees[1:]:
        paired = [x - y for x, y in zip(res["this"]["ttft"], res[name]["ttft"])]
        ratios[name] = {"ttft_p50": round(p50["this"]["ttft"] / p50[name]["ttft"], 3),
                        "cpu_per_request_p50": round(p50["this"]["cpu"] / p50[name]["cpu"], 3),
                        "ttft_paired_diff_ms_p50": round(statistics.median(paired), 3)}
        print(f"this / {name}: TTFT p50 {ratios[name]['ttft_p50']}, CPU per request p50 "
              f"{ratios[name]['cpu_per_request_p50']}, paired TTFT difference p50 "
              f"{ratios[name]['ttft_paired_diff_ms_p50']} ms")
    print(json.dumps({"bench": "router_ttft", "requests": a.requests, "tokens": a.tokens, "token_ms": a.token_ms,
                      "roots": {n: str(r) for n, r in trees}, "p50": p50, "vs": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
