"""Early dispatch on vs off (issue 37): the hand-off gap at the client, in one run, on the same workers.

    PYTHONPATH=$PWD python benchmarks/overlap_bench.py [--lengths 500,2000,8000] [--requests 8] [--output 32]

One real 1P1D stack through the launcher (router, P and D vLLM CPU workers, one core each, KV pool off) on a random
fp32 Llama from ``pdserve.launch.models`` (``--layers``, ``--hidden``); its router is ``cont`` (early dispatch, D
continues after P's first token). Two more routers over the same two workers: ``serial`` (``--no-early-dispatch``)
and ``early`` (``--no-early-continue``: D regenerates P's first token, the router compares). The requests rotate
between the three routers (which one goes first rotates too), one at a time, each with its own random prompt (no
prefix-cache hit on P or D), greedy, ``ignore_eos``, streamed. Per request, at the client:

* ``ttft``: send -> the first token (P's, streamed at once on both paths);
* ``gap``: the first token -> the second (the hand-off: D's first token);
* ``tpot``: the mean time per token after the second.

And from D's connector (its ``hand-off {json}`` log lines, same host, same wall clock, matched to the request by
time): ``read`` (the READ of P's blocks; for ``cont`` up to the answer to D's second question, P's first token) and,
for the early paths, ``read_hidden``: the share of the read that was
over before the client had P's first token. Layer-wise sends (issue 37 item 2) are not built, so no byte moves
before P's last forward ends: the read overlaps P's answer (its HTTP path to the router and the client), not P's
compute, and P's prefill throughput is the same code on both paths (not measured here).

Prints a table (p50 / p99 ms per length and path), the ratios early / serial, cont / serial and cont / early of the
gap p50 and the gap p50 over TPOT p50, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


PATHS = ("serial", "early", "cont")  # serial hand-off; early dispatch, D regenerates t1; early, D continues after t1


def pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def stream(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """One streamed completion: wall-clock send time and each token's arrival."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    t_send = time.time()
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
    arrivals: list[float] = []
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            line = event.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            now = time.time()
            for c in obj.get("choices") or []:
                arrivals += [now] * len(c.get("token_ids") or []) if c.get("token_ids") else ([now] if c.get("text")
                                                                                                else [])
    conn.close()
    return {"send": t_send, "arrivals": arrivals, "end": time.time()}


def d_stamps(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        at = line.find("hand-off {")
        if at >= 0:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[at + len("hand-off "):]))
    return out


def measure(rec: dict[str, Any], stamps: list[dict[str, Any]]) -> dict[str, float]:
    a = rec["arrivals"]
    row = {"ttft": (a[0] - rec["send"]) * 1e3, "gap": (a[1] - a[0]) * 1e3,
           "tpot": (a[-1] - a[1]) / max(1, len(a) - 2) * 1e3}
    mine = [s for s in stamps if rec["send"] <= (s.get("arrive") or 0) <= rec["end"]]
    if len(mine) == 1 and mine[0].get("read_start") and mine[0].get("read_end"):
        s = mine[0]
        read = s["read_end"] - s["read_start"]
        row["read"] = read * 1e3
        if read > 0:
            row["read_hidden"] = max(0.0, min(s["read_end"], a[0]) - s["read_start"]) / read
    return row


def second_router(model: str, name: str, max_len: int, p: str, d: str, log: Path,
                  flag: str = "--no-early-dispatch") -> tuple[Any, str]:
    from pdserve.launch.procs import free_port, spawn_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = spawn_healthy(f"router{flag}", [
        sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(port), "--model-dir", model,
        "--served-model-name", name, "--max-model-len", str(max_len), "--prefill", p, "--decode", d,
        flag], url, timeout_s=180, log_path=log)
    return child, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="500,2000,8000")
    ap.add_argument("--requests", type=int, default=8, help="per length and path")
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    max_len = max(lengths) + a.output + 64

    from pdserve.bench.compare import CompareSettings, launcher_config
    from pdserve.launch import Cluster
    from pdserve.launch.models import build_random_llama
    from pdserve.launch.procs import stop_children

    tmp = Path(tempfile.mkdtemp(prefix="overlap-bench-"))
    model = build_random_llama(tmp / "model", layers=a.layers, hidden=a.hidden,
                               max_position_embeddings=max(8192, max_len))
    cfg = launcher_config("1p1d", CompareSettings(model=str(model), dtype="float32", max_model_len=max_len,
                                                  run_dir=str(tmp / "run")))
    cfg = dataclasses.replace(cfg, pool=False, served_model_name="m")
    rng = random.Random(a.seed)
    recs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    t0 = time.monotonic()
    with Cluster(cfg) as c:
        p, d = c.worker_urls("prefill")[0], c.worker_urls("decode")[0]
        child, serial = second_router(str(model), "m", max_len, p, d, tmp / "serial.log")
        # early dispatch with D regenerating P's first token (issue 37 before D continued after it)
        regen_child, regen = second_router(str(model), "m", max_len, p, d, tmp / "regen.log", "--no-early-continue")
        try:
            routers = {"cont": c.router_url, "early": regen, "serial": serial}

            def body(n: int) -> dict[str, Any]:
                return {"model": "m", "max_tokens": a.output, "temperature": 0,
                        "ignore_eos": True, "prompt": [rng.randrange(1000, 40000) for _ in range(n)]}

            for url in routers.values():  # warm-up; the early router learns P's engine from P's first answer
                stream(url, body(64))
            for n in lengths:
                for i in range(a.requests):
                    order = PATHS[i % 3:] + PATHS[:i % 3]  # which goes first rotates
                    for path in order:
                        recs.setdefault((n, path), []).append(stream(routers[path], body(n)))
            stamps = d_stamps(Path(c.run_dir) / "decode0.log")
        finally:
            stop_children([child, regen_child])
    wall = time.monotonic() - t0
    load = os.getloadavg()
    out: dict[str, Any] = {"model": f"random llama fp32, {a.layers} layers, hidden {a.hidden}", "output": a.output,
                           "requests": a.requests, "wall_s": round(wall, 1), "loadavg": [round(x, 2) for x in load],
                           "lengths": {}}
    print(f"{'tokens':>6} {'path':>6} | {'ttft p50':>8} {'gap p50':>8} {'gap p99':>8} {'tpot p50':>8} "
          f"{'gap/tpot':>8} {'read p50':>8} {'hidden':>7}")
    for n in lengths:
        per: dict[str, Any] = {}
        for path in PATHS:
            rows = [measure(r, stamps) for r in recs[(n, path)]]
            col = {k: [r[k] for r in rows if k in r] for k in ("ttft", "gap", "tpot", "read", "read_hidden")}
            s = {"ttft_p50": pct(col["ttft"], .5), "gap_p50": pct(col["gap"], .5), "gap_p99": pct(col["gap"], .99),
                 "tpot_p50": pct(col["tpot"], .5), "read_p50": pct(col["read"], .5),
                 "read_hidden_mean": statistics.fmean(col["read_hidden"]) if col["read_hidden"] else float("nan"),
                 "joined": len(col["read"])}
            s["gap_over_tpot"] = s["gap_p50"] / s["tpot_p50"]
            per[path] = {k: round(v, 3) for k, v in s.items()}
            print(f"{n:>6} {path:>6} | {s['ttft_p50']:8.1f} {s['gap_p50']:8.1f} {s['gap_p99']:8.1f} "
                  f"{s['tpot_p50']:8.1f} {s['gap_over_tpot']:8.2f} {s['read_p50']:8.1f} "
                  f"{s['read_hidden_mean']:7.2f}")
        per["gap_p50_ratio_early_over_serial"] = round(per["early"]["gap_p50"] / per["serial"]["gap_p50"], 3)
        per["gap_p50_ratio_cont_over_serial"] = round(per["cont"]["gap_p50"] / per["serial"]["gap_p50"], 3)
        per["gap_p50_ratio_cont_over_early"] = round(per["cont"]["gap_p50"] / per["early"]["gap_p50"], 3)
        print(f"{n:>6}  gap p50 early / serial: {per['gap_p50_ratio_early_over_serial']:.2f}, cont / serial: "
              f"{per['gap_p50_ratio_cont_over_serial']:.2f}, cont / early: {per['gap_p50_ratio_cont_over_early']:.2f}")
        out["lengths"][str(n)] = per
    print(json.dumps(out))


if __name__ == "__main__":
    main()
