"""What a move of a running decode does to it (issue 16, item 1): two elastic workers, a decode R streaming on worker
A, a second decode S on B, then a long prompt L whose prefill the conductor puts on A. With moves on (the default)
R moves to B before L's prefill starts; with ``--no-moves`` R stays on A and L's prefill stalls it. Both routers
run over the same two workers (`pdserve serve --elastic 2`'s, plus a second router started with ``--no-moves``),
alternating, so they see the same machine.

Reported per configuration (medians over the rounds): R's longest gap between two streamed chunks from L's arrival
on (the stall it suffered), R's mean time per output token (first to last chunk), L's end-to-end time (its TTFT + 3
decode steps), and how many moves the router made. Ratios are moves on / moves off; the last line is JSON.

    python benchmarks/move_bench.py [--model DIR] [--rounds 3] [--long 1500] [--calibrate]

Without ``--model`` a small random Llama is built (pdserve.launch.models). ``--calibrate`` lets the router time the
workers at start-up (the conductor then predicts with measured costs, and may decide that no move pays on this machine).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.prom import scrape  # noqa: E402
from pdserve.launch import Cluster  # noqa: E402
from pdserve.launch.config import LauncherConfig  # noqa: E402
from pdserve.launch.models import model_or_random_llama  # noqa: E402
from pdserve.launch.procs import free_port, spawn_healthy, stop_children  # noqa: E402

R_TOKENS = 220  # R: 20 prompt tokens, this many output tokens


def _body(n: int, seed: int, max_tokens: int, stream: bool = False) -> dict:
    rng = random.Random(seed)
    return {"model": "m", "prompt": [rng.randrange(1000, 30000) for _ in range(n)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


class Stream(threading.Thread):
    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.stamps: list[float] = []
        self.started = threading.Event()

    def run(self) -> None:
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(self.body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                for line in resp:
                    if line.startswith(b"data: {"):
                        self.stamps.append(time.perf_counter())
                        self.started.set()
        finally:
            self.started.set()


def one_round(router: str, seed: int, long_tokens: int) -> dict:
    r = Stream(router, _body(20, seed, R_TOKENS, True))
    r.start()
    r.started.wait(120)
    s = Stream(router, _body(250, seed + 1, 120, True))
    s.start()
    s.started.wait(120)
    t0 = time.perf_counter()
    _post(router, _body(long_tokens, seed + 2, 4))
    long_s = time.perf_counter() - t0
    r.join(300)
    s.join(300)
    after = [b - a for a, b in zip(r.stamps, r.stamps[1:]) if b > t0]  # R's gaps from L's arrival on
    tpot = (r.stamps[-1] - r.stamps[0]) / (R_TOKENS - 1)
    return {"max_gap_ms": max(after, default=0.0) * 1e3, "tpot_mean_ms": tpot * 1e3, "long_e2e_ms": long_s * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long", type=int, default=1500, help="L's prompt tokens")
    ap.add_argument("--calibrate", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="move-bench-"))
    model = model_or_random_llama(a.model, tmp)
    extra = ("--local-prefill-tokens", "256") + (() if a.calibrate else ("--no-calibrate",))
    cfg = LauncherConfig(model=model, elastic=2, policy="conductor", port=0, dtype="float32", max_model_len=4096,
                         served_model_name="m", pool=False, worker_timeout_s=600, run_dir=str(tmp / "run"),
                         router_args=extra)
    with Cluster(cfg) as c:
        urls = c.worker_urls("elastic")
        port = free_port()
        off_url = f"http://127.0.0.1:{port}"
        off = spawn_healthy("router-no-moves", [
            sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(port), "--model-dir",
            str(c.model_dir), "--served-model-name", "m", "--max-model-len", "4096", "--policy", "conductor", *extra,
            "--no-moves", "--elastic", *urls], off_url, 180, log_path=tmp / "router-no-moves.log")
        try:
            rows: dict[str, list[dict]] = {"moves": [], "no_moves": []}
            for i in range(a.rounds):
                for name, url in (("moves", c.router_url), ("no_moves", off_url)):
                    before = scrape(url, "pdserve_router_moves_total").get("pdserve_router_moves_total", 0.0)
                    row = one_round(url, 100 * i, a.long)
                    row["moved"] = scrape(url, "pdserve_router_moves_total").get("pdserve_router_moves_total",
                                                                                 0.0) - before
                    rows[name].append(row)
                    print(f"round {i} {name:9} R max gap {row['max_gap_ms']:6.0f} ms, R TPOT "
                          f"{row['tpot_mean_ms']:5.2f} ms, L e2e {row['long_e2e_ms']:6.0f} ms, "
                          f"moved {row['moved']:.0f}", flush=True)
            moved = {"moves": scrape(c.router_url, "pdserve_router_moves_total").get("pdserve_router_moves_total", 0),
                     "no_moves": scrape(off_url, "pdserve_router_moves_total").get("pdserve_router_moves_total", 0)}
        finally:
            stop_children([off], timeout_s=20)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    print(f"{'config':10} {'R max gap ms':>13} {'R TPOT ms':>10} {'L e2e ms':>9} {'moves':>6}")
    for name in ("no_moves", "moves"):
        m = med[name]
        print(f"{name:10} {m['max_gap_ms']:13.0f} {m['tpot_mean_ms']:10.2f} {m['long_e2e_ms']:9.0f} {moved[name]:6.0f}")
    ratio = {k: med["moves"][k] / med["no_moves"][k] for k in ("max_gap_ms", "tpot_mean_ms", "long_e2e_ms")}
    print(json.dumps({"bench": "move", "rounds": a.rounds, "long_tokens": a.long, "calibrate": a.calibrate,
                      "median": med, "moves": moved, "ratio_moves_over_no_moves": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
