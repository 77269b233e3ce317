"""What tracing costs the router: router CPU per streamed token (closed-loop load) and TTFT (one request at a time)
with tracing off, on at 100% sampling, and on at 0% (every request sampled out), routers of this tree in front
of the same fake vLLM-shaped P and D workers (router_ceiling_bench.py's), in one run.

    python benchmarks/tracing_bench.py [--streams 32] [--tokens 200] [--token-ms 5] [--window-s 6] [--repeat 3]
                                       [--requests 100] [--baseline-root DIR]

``--baseline-root DIR`` (another pdserve tree, e.g. ``git archive REV pdserve | tar -x -C DIR`` of the commit before
tracing) adds the case "today": that tree's router, same flags but tracing's, so "off" can be read against it.

"on" routers export over OTLP/gRPC to a real collector process (tests/integration/otlp_collector.py, which writes
every span it receives to a file: the bench checks that it got the spans of the on-case's requests). The cases take
turns in each round (the order rotating), so a busy machine slows them alike; the table gives medians and ratios
against "off" (today's path: no middleware, no span). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import router_ceiling_bench as rc
import router_ttft_bench as rt

ROOT = Path(__file__).resolve().parents[1]
CASES = {"off": [], "on_100": ["--otlp-traces-sample-ratio", "1"], "on_0": ["--otlp-traces-sample-ratio", "0"]}


def start_router(model: Path, workers: dict[str, list[str]], extra: list[str], log: Path, root: Path = ROOT
                 ) -> tuple[subprocess.Popen, int]:
    """router_ceiling_bench's router command line, plus ``extra``."""
    return rc._start_router(root, model, workers, log, tuple(extra))


def start_collector(out: Path) -> tuple[subprocess.Popen, int]:
    port = rc._free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.otlp_collector", str(port), str(out)],
                            cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc, port


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32, help="concurrent P -> D streams of the CPU cases")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per request")
    ap.add_argument("--token-ms", type=float, default=5.0, help="the fake workers' time per token")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--window-s", type=float, default=6.0, help="the measured window of each CPU case")
    ap.add_argument("--requests", type=int, default=100, help="TTFT: measured requests per case (after 10)")
    ap.add_argument("--ttft-tokens", type=int, default=16, help="TTFT: tokens per request")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the CPU cases")
    ap.add_argument("--baseline-root", default="", help="a pdserve tree without tracing: the case 'today'")
    a = ap.parse_args()
    cases = dict(CASES)
    if a.baseline_root:
        cases["today"] = []
    tmp = Path(tempfile.mkdtemp(prefix="tracing-bench-"))
    model = rc._write_model(tmp / "model")
    spans_file = tmp / "spans.jsonl"
    spans_file.touch()
    collector, cport = start_collector(spans_file)
    wports = {role: rc._free_port() for role in ("prefill", "decode")}
    fakes = [subprocess.Popen([sys.executable, rc.__file__, "--fake-worker", str(p), "--token-ms", str(a.token_ms),
                               "--tokens", str(a.tokens), "--stream-interval", "1"], start_new_session=True)
             for p in wports.values()]
    routers: dict[str, tuple[subprocess.Popen, int]] = {}
    cpu: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    try:
        for p, f in zip(wports.values(), fakes):
            rc._wait_http(p, "/health", 30, f)
        workers = {role: [f"http://127.0.0.1:{p}"] for role, p in wports.items()}
        for case, extra in cases.items():
            flags = extra + (["--otlp-traces-endpoint", f"http://127.0.0.1:{cport}"] if case.startswith("on") else [])
            root = Path(a.baseline_root).resolve() if case == "today" else ROOT
            routers[case] = start_router(model, workers, flags, tmp / f"router-{case}.log", root)
        for proc, port in routers.values():
            rc._wait_http(port, "/ready", 120, proc)
        names = list(cases)
        for rnd in range(a.repeat):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for case in order:
                proc, port = routers[case]
                row = asyncio.run(rc._drive([port], a.streams, a.tokens, a.warmup_s, a.window_s,
                                            lambda pid=proc.pid: rc._cpu_s(pid)))
                cpu[case].append(row)
                print(f"  round {rnd + 1}: {case:7} {row['tokens_per_s']:8.0f} tok/s, "
                      f"{row['cpu_ms_per_token'] or 0:.4f} router CPU ms/token, {row['failed']} failed", flush=True)
        ttft = asyncio.run(rt._rounds([(c, routers[c][0], routers[c][1]) for c in names], a.requests, a.ttft_tokens))
    finally:
        for proc, _ in routers.values():
            rc._stop(proc)
        for f in fakes:
            rc._stop(f)
    for proc, _ in list(routers.values()):
        proc.wait()
    rc._stop(collector)
    spans = [json.loads(line) for line in spans_file.read_text().splitlines() if line]
    traced = len({s["trace_id"] for s in spans if s["name"].startswith("POST ")})

    rows = []
    for case in names:
        ms_tok = _med([r["cpu_ms_per_token"] for r in cpu[case] if r["cpu_ms_per_token"]])
        rows.append({"case": case, "router_cpu_ms_per_token": round(ms_tok, 5),
                     "tokens_per_s": round(_med([r["tokens_per_s"] for r in cpu[case]])),
                     "ttft_p50_ms": round(_med(ttft[case]["ttft"]), 3),
                     "cpu_per_request_p50_ms": round(_med(ttft[case]["cpu"]), 3),
                     "failed": sum(r["failed"] for r in cpu[case])})
    off = rows[0]
    for r in rows:
        r["cpu_per_token_vs_off"] = round(r["router_cpu_ms_per_token"] / off["router_cpu_ms_per_token"], 3)
        r["ttft_p50_vs_off"] = round(r["ttft_p50_ms"] / off["ttft_p50_ms"], 3)
    load = os.getloadavg()
    print(f"\ntracing cost: fake P and D, {a.streams} streams x {a.tokens} tokens ({a.token_ms:g} ms/token), "
          f"{a.repeat} round(s) of {a.window_s:g} s; TTFT: {a.requests} requests of {a.ttft_tokens} tokens one at a "
          f"time; load {load[0]:.1f}; the collector received {len(spans)} spans of {traced} traced requests")
    cols = ["case", "router_cpu_ms_per_token", "cpu_per_token_vs_off", "tokens_per_s", "ttft_p50_ms",
            "ttft_p50_vs_off", "cpu_per_request_p50_ms", "failed"]
    print(" | ".join(f"{c:>24}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]!s:>24}" for c in cols))
    on = rows[names.index("on_100")]
    today = rows[names.index("today")] if "today" in names else None
    print(json.dumps({"bench": "tracing", "streams": a.streams, "tokens": a.tokens, "token_ms": a.token_ms,
                      "repeat": a.repeat, "requests": a.requests, "load1": round(load[0], 2), "spans": len(spans),
                      "traced_requests": traced, "rows": rows, "ratio": on["cpu_per_token_vs_off"],
                      "ratio_means": "router CPU per streamed token, tracing on at 100% / off, same run",
                      "ttft_ratio": on["ttft_p50_vs_off"],
                      "off_vs_today_cpu_per_token": round(off["router_cpu_ms_per_token"] /
                                                          today["router_cpu_ms_per_token"], 3) if today else None,
                      "off_vs_today_ttft_p50": round(off["ttft_p50_ms"] / today["ttft_p50_ms"], 3) if today else None}))
    return 0 if traced > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
