"""What the router adds per request and per streamed token, against the same vLLM worker called directly.

    python benchmarks/router_overhead_bench.py [--requests 20] [--prompt 100] [--output 64] [--model DIR]
                                               [--profile-requests 10] [--baseline-root DIR] [--out DIR]

Starts the ``pdserve serve --colocated 1 --cores-per-worker 2`` stack (one real vLLM worker on up to two cores,
fp32, and the router in front of it) with a small random Llama from ``pdserve.launch.models`` (or ``--model``). Sends
``--requests`` identical streamed completions (greedy, ``ignore_eos``, a fixed ``--prompt``-token prompt,
``--output`` tokens) one at a time, alternately to the router and straight to the worker, and reports TTFT p50
and end-to-end p50 for both, the ms the router adds to TTFT, and the ms it adds per streamed token
((e2e_router - e2e_direct) / output tokens, medians), plus the router process's CPU time per streamed token
(from /proc, read around each routed request). With ``--baseline-root DIR`` (another pdserve source tree, e.g.
``git archive REV pdserve | tar -x -C DIR``) a router from DIR runs in front of the same worker in the same
rotation, beside a router from this tree started with the same command line (``same``: the launch's router has
launch-only flags, such as ``--membership-file``, whose work would be counted too), and the result compares those
two (CPU per token p50 / mean ratios, the median of the rounds' ratios, TTFT added).

Then it finds where the router's time goes: a second router process in front of the same worker runs under
cProfile (switched on and off by signals around ``--profile-requests`` requests only, so start-up and health
probes are left out) and the table lists its top functions by own time, per streamed token, and the totals of
the candidate costs (worker SSE parsing, stop strings, chunk building and SSE encoding, socket writes, the event
loop). Its clock is the router thread's CPU time by default (``--profile-timer cpu``), so other processes on
busy cores do not inflate it. cProfile slows Python code down, so its times rank the costs; the unprofiled
router's figures above are the ones to quote. With ``--floor`` a bare asyncio TCP relay (no HTTP parsing, one
``transport.write`` per read) runs in the same rotation: the lower bound of a CPython router's CPU per token on
this machine. Prints tables and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relay_floor import start_floor  # noqa: E402  (benchmarks/relay_floor.py, next to this file)

# where the router's per-token work lives: group -> (file fragment, function-name fragment) pairs; built-ins
# have the file "~" and their name in the function ("<method 'poll' of 'select.epoll' objects>")
GROUPS: dict[str, tuple[tuple[str, str], ...]] = {
    "worker stream: read + SSE split + json.loads": (
        ("router/workers/client.py", "stream"), ("router/workers/client.py", "_sse_data"), ("json/decoder.py", ""),
        ("json/__init__.py", "loads"), ("aiohttp/streams.py", ""), ("aiohttp/client_proto.py", ""),
        ("aiohttp/http_parser.py", ""), ("~", "scanstring"), ("~", "recv")),
    "the run: attempts, Delta, stop strings, output": (("router/run/generation.py", ""), ("router/run/attempt.py", ""),
                                                      ("router/run/output.py", ""), ("router/run/interrupts.py", "")),
    "ticket.progress (placement, conductor)": (("router/fleet/ticket.py", ""), ("router/fleet/placement.py", ""),
                                               ("/conductor/", "")),
    "detokenizing": (("router/api/tokenizer.py", ""), ("tokenizers", ""), ("transformers", "")),
    "chunk build + SSE encode (protocol.py, json.dumps)": (("router/api/protocol.py", ""), ("json/encoder.py", ""),
                                                           ("json/__init__.py", "dumps"), ("~", "encode_basestring"),
                                                           ("~", "c_make_encoder")),
    "app._stream loop": (("router/app.py", ""),),
    "client socket writes": (("aiohttp/web_response.py", ""), ("aiohttp/http_writer.py", ""),
                             ("asyncio/selector_events.py", ""), ("asyncio/streams.py", ""),
                             ("~", "'send' of '_socket.socket'")),
    "event loop (select, callbacks)": (("asyncio/base_events.py", ""), ("selectors.py", ""),
                                       ("asyncio/events.py", ""), ("asyncio/futures.py", ""),
                                       ("asyncio/tasks.py", "")),
    "idle: waiting in epoll (not a cost)": (("~", "select.epoll"),),
}
IDLE = "idle: waiting in epoll (not a cost)"


# ----------------------------------------------------------------------------- the profiled router (child mode)

def profiled_router(prof_path: str, timer: str, loop: str, router_argv: list[str]) -> int:
    """Run ``python -m pdserve.router ROUTER_ARGV`` in this process; SIGUSR1 starts cProfile, SIGUSR2 stops it and
    writes ``prof_path``. ``timer``: ``cpu`` (the main thread's CPU time: waits and preemption by other processes
    on busy cores cost nothing) or ``wall``. ``loop``: ``asyncio`` (as shipped) or ``uvloop`` (installed as the
    event loop policy before the router starts: what the router would gain from it, without changing it)."""
    import cProfile

    if loop == "uvloop":
        import uvloop

        uvloop.install()

    prof = cProfile.Profile(time.thread_time) if timer == "cpu" else cProfile.Profile()

    def on(signum: int, frame: Any) -> None:  # noqa: ARG001
        prof.enable()

    def off(signum: int, frame: Any) -> None:  # noqa: ARG001
        prof.disable()
        prof.dump_stats(prof_path + ".tmp")
        os.replace(prof_path + ".tmp", prof_path)

    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)
    from pdserve.router.__main__ import main as router_main

    return router_main(router_argv)


# ----------------------------------------------------------------------------- measuring

def _cpu_s(pid: int) -> float:
    """CPU time of all a process's threads, seconds, to the nanosecond (``/proc/PID/task/*/schedstat``; the
    utime/stime of ``/proc/PID/stat`` count 10 ms ticks, too coarse for one request's fraction of a ms per token)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


async def _one(session: Any, url: str, payload: dict[str, Any], timings: bool) -> Any:
    from pdserve.bench.client import stream_completion

    rec = await stream_completion(session, url, payload, timeout_s=120.0, timings=timings)
    if not rec.ok:
        raise RuntimeError(f"request to {url} failed: {rec.error}")
    return rec


async def alternate(targets: list[tuple[str, str, int | None]], payload: dict[str, Any], n: int,
                    warmup: int = 2) -> dict[str, list[Any]]:
    """``n`` requests to each ``(name, url, pid)`` target, in rounds whose order rotates (each target first in
    turn), so a load change on the cores hits them alike. Routers (a pid) send timings and get their process's CPU
    time read around each request (``NAME_cpu_s``)."""
    import aiohttp

    out: dict[str, list[Any]] = {}
    for name, _, pid in targets:
        out[name] = []
        if pid is not None:
            out[name + "_cpu_s"] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(warmup):
            for name, url, pid in targets:
                await _one(session, url, payload, pid is not None and name != "floor")
        for i in range(n):
            k = i % len(targets)
            for name, url, pid in targets[k:] + targets[:k]:
                if pid is None:
                    out[name].append(await _one(session, url, payload, False))
                    continue
                c0 = _cpu_s(pid)
                out[name].append(await _one(session, url, payload, name != "floor"))
                out[name + "_cpu_s"].append(_cpu_s(pid) - c0)
    return out


async def through(url: str, payload: dict[str, Any], n: int) -> list[Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return [await _one(session, url, payload, True) for _ in range(n)]


def _p50_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000.0, 3)


def summarize(runs: dict[str, list[Any]], output: int, router: str = "router") -> dict[str, Any]:
    r, d = runs[router], runs["direct"]
    tokens = [x.output_tokens for x in r]
    if any(t != output for t in tokens + [x.output_tokens for x in d]):
        raise RuntimeError(f"expected {output} tokens per request, got router {tokens}")
    ttft_r, ttft_d = _p50_ms([x.ttft_s for x in r]), _p50_ms([x.ttft_s for x in d])
    e2e_r, e2e_d = _p50_ms([x.latency_s for x in r]), _p50_ms([x.latency_s for x in d])
    # paired: each routed request against the direct one sent next to it (same load on the cores)
    paired = [(a.latency_s - b.latency_s) * 1000.0 / output for a, b in zip(r, d)]
    per_tok = round(statistics.median(paired), 4)
    itl_r = [b - a for x in r for a, b in zip(x.chunk_times, x.chunk_times[1:])]
    itl_d = [b - a for x in d for a, b in zip(x.chunk_times, x.chunk_times[1:])]
    ttft_paired = [(a.ttft_s - b.ttft_s) * 1000.0 for a, b in zip(r, d)]
    queue = [x.timings.get("queue_ms") for x in r if x.timings]
    relayed = [x.timings.get("relayed_tokens") for x in r if x.timings]
    overhead = [x.timings.get("router_overhead_ms") for x in r if x.timings]
    client_wait = [x.timings.get("client_wait_ms") for x in r if x.timings]
    cpu_per_tok = [c * 1000.0 / output for c in runs[router + "_cpu_s"]]
    return {
        "requests": len(r), "output_tokens": output,
        "ttft_p50_ms": {"router": ttft_r, "direct": ttft_d},
        "e2e_p50_ms": {"router": e2e_r, "direct": e2e_d},
        "itl_p50_ms": {"router": _p50_ms(itl_r), "direct": _p50_ms(itl_d)},
        "added_ttft_ms": round(ttft_r - ttft_d, 3),
        "added_ttft_ms_paired_p50": round(statistics.median(ttft_paired), 3),
        "queue_ms_p50": round(statistics.median(q for q in queue if q is not None), 3)
        if any(q is not None for q in queue) else None,
        "relayed_tokens_p50": statistics.median(n for n in relayed if n is not None)
        if any(n is not None for n in relayed) else None,
        "added_ms_per_token": per_tok,
        "added_ms_per_token_from_p50s": round((e2e_r - e2e_d) / output, 4),
        "e2e_ratio": round(e2e_r / e2e_d, 4),
        "router_cpu_ms_per_token_p50": round(statistics.median(cpu_per_tok), 4),
        "router_cpu_ms_per_token_mean": round(sum(runs[router + "_cpu_s"]) * 1000.0 / sum(tokens), 4),
        "router_overhead_ms_p50": round(statistics.median(o for o in overhead if o is not None), 3)
        if overhead else None,
        "client_wait_ms_p50": round(statistics.median(c for c in client_wait if c is not None), 3)
        if any(c is not None for c in client_wait) else None,
    }


def profile_table(prof_path: str, tokens: int, top: int = 20) -> dict[str, Any]:
    """Top functions by own time, and the candidate groups' totals, in ms per streamed token."""
    st = pstats.Stats(prof_path)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = st.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())
    rows = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    top_rows = [{"function": f"{Path(f).name}:{ln}({fn})" if ln else fn, "calls_per_token": round(v[1] / tokens, 2),
                 "own_ms_per_token": round(v[2] * 1000.0 / tokens, 4),
                 "cum_ms_per_token": round(v[3] * 1000.0 / tokens, 4)} for (f, ln, fn), v in rows]
    groups: dict[str, float] = {}
    for name, keys in GROUPS.items():
        own = 0.0
        for (f, _ln, fn), v in raw.items():
            if any(frag in f and want in fn for frag, want in keys):
                own += v[2]
        groups[name] = round(own * 1000.0 / tokens, 4)
    pdserve_own = sum(v[2] for (f, _ln, _fn), v in raw.items() if "/pdserve/" in f)
    busy = total - groups[IDLE] * tokens / 1000.0
    return {"profiled_ms_per_token": round(total * 1000.0 / tokens, 4),
            "busy_ms_per_token": round(busy * 1000.0 / tokens, 4),
            "pdserve_code_own_ms_per_token": round(pdserve_own * 1000.0 / tokens, 4),
            "groups_own_ms_per_token": groups, "top": top_rows}


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def start_router(cluster: Any, root: Path, out_dir: Path, name: str) -> tuple[subprocess.Popen, str]:
    """A router process from the source tree ``root`` (e.g. an older commit's ``git archive``) in front of the
    cluster's worker; returns (process, url) once its /health answers 200."""
    from pdserve.launch.procs import free_port, spawn_healthy

    port = free_port()
    argv = [sys.executable, "-m", "pdserve.router", "--model-dir", str(cluster.model_dir), "--colocated",
            cluster.worker_urls()[0], "--port", str(port), "--served-model-name", cluster.model_name,
            "--log-level", "warning"]
    child = spawn_healthy(f"{name} router", argv, f"http://127.0.0.1:{port}", 120, cwd=str(root),
                          env=dict(os.environ, PYTHONPATH=str(root)), log_path=out_dir / f"router-{name}.log")
    return child.proc, child.url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def run_profile(cluster: Any, payload: dict[str, Any], n: int, out_dir: Path, timer: str, loop: str
                ) -> dict[str, Any]:
    """A second router in front of the same worker, on event loop ``loop``: its CPU per token over ``n`` requests
    unprofiled, then a cProfile of ``n`` more requests only."""
    from pdserve.launch.procs import free_port, spawn_healthy

    port = free_port()
    prof = out_dir / f"router-{loop}.prof"
    prof.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--profiled-router", str(prof), timer, loop, "--",
            "--model-dir", str(cluster.model_dir), "--colocated", cluster.worker_urls()[0], "--port", str(port),
            "--served-model-name", cluster.model_name, "--log-level", "warning"]
    child = spawn_healthy("profiled router", argv, f"http://127.0.0.1:{port}", 120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), log_path=out_dir / f"profiled-router-{loop}.log")
    proc, url = child.proc, child.url
    try:
        asyncio.run(through(url, payload, 2))  # warm-up, not profiled
        cpu: list[float] = []
        for _ in range(n):
            c0 = _cpu_s(proc.pid)
            rec = asyncio.run(through(url, payload, 1))[0]
            cpu.append((_cpu_s(proc.pid) - c0) * 1000.0 / rec.output_tokens)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.3)
        recs = asyncio.run(through(url, payload, n))
        proc.send_signal(signal.SIGUSR2)
        _wait_for(prof, 30)
        tokens = sum(r.output_tokens for r in recs)
        table = profile_table(str(prof), tokens)
        table["requests"], table["timer"], table["loop"] = n, timer, loop
        table["unprofiled_cpu_ms_per_token_p50"] = round(statistics.median(cpu), 4)
        table["unprofiled_cpu_ms_per_token_mean"] = round(statistics.fmean(cpu), 4)
        table["profiled_e2e_p50_ms"] = _p50_ms([r.latency_s for r in recs])
        return table
    finally:
        stop(proc)


# ----------------------------------------------------------------------------- main

def _model(path: str) -> str:
    if path:
        return path
    from pdserve.launch.models import build_random_llama

    out = ROOT / ".pdserve" / "bench-models" / "router-overhead-llama"
    return str(build_random_llama(out, dtype="float32"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--profiled-router"]:
        sep = argv.index("--")
        return profiled_router(argv[1], argv[2], argv[3], argv[sep + 1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20, help="requests to each of router and worker (default 20)")
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens (default 100)")
    ap.add_argument("--output", type=int, default=64, help="output tokens (default 64)")
    ap.add_argument("--model", default="", help="model folder (default: a small random Llama, built once)")
    ap.add_argument("--profile-requests", type=int, default=10, help="requests through the profiled router (0: "
                    "skip the profile)")
    ap.add_argument("--profile-timer", choices=("cpu", "wall"), default="cpu",
                    help="cProfile's clock: the router thread's CPU time (default; robust to busy cores) or wall")
    ap.add_argument("--profile-loops", default="asyncio,uvloop",
                    help="event loops to run the profiled router on, in turn (asyncio as shipped; uvloop if installed)")
    ap.add_argument("--baseline-root", default="", help="a source tree holding another pdserve (e.g. `git archive "
                    "REV pdserve | tar -x -C DIR`): its router runs in front of the same worker, in the same "
                    "alternation, and the result gives this router's figures against it")
    ap.add_argument("--floor", action="store_true", help="also run a bare asyncio TCP relay (no HTTP parsing) in "
                    "front of the same worker, in the same alternation: the lower bound of a Python router's CPU per "
                    "token on this loop")
    ap.add_argument("--out", default="", help="folder for router.prof and logs (default: a temporary one)")
    args = ap.parse_args(argv)
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig

    out_dir = Path(args.out or tempfile.mkdtemp(prefix="router-overhead-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))[:2]
    cfg = LauncherConfig(model=_model(args.model), colocated=1, cores=tuple(cores), cores_per_worker=len(cores),
                         dtype="float32", port=0, max_model_len=max(512, args.prompt + args.output + 16),
                         run_dir=str(out_dir / "run"))
    payload = {"prompt": [1000 + (7 * i) % 5000 for i in range(args.prompt)], "max_tokens": args.output,
               "temperature": 0, "ignore_eos": True}
    say = lambda s: print(f"[router_overhead] {s}", file=sys.stderr, flush=True)  # noqa: E731
    with Cluster(cfg, log=say) as cluster:
        payload["model"] = cluster.model_name
        assert cluster.router is not None
        targets: list[tuple[str, str, int | None]] = [("router", cluster.router_url, cluster.router.pid),
                                                      ("direct", cluster.worker_urls()[0], None)]
        base = same = floor = None
        try:
            if args.baseline_root:
                base, base_url = start_router(cluster, Path(args.baseline_root).resolve(), out_dir, "baseline")
                targets.insert(1, ("baseline", base_url, base.pid))
                # this tree's router started exactly as the baseline is (same argv): the like-for-like comparison
                # (the launch's router has launch-only flags, such as --membership-file, whose work is counted too)
                same, same_url = start_router(cluster, ROOT, out_dir, "same")
                targets.insert(1, ("same", same_url, same.pid))
            if args.floor:
                floor, floor_url = start_floor(cluster.worker_urls()[0], out_dir)
                targets.insert(1, ("floor", floor_url, floor.pid))
            say(f"{args.requests} requests each, alternating {', '.join(f'{n} {u}' for n, u, _ in targets)}")
            runs = asyncio.run(alternate(targets, payload, args.requests))
        finally:
            for proc in (base, same, floor):
                if proc is not None:
                    stop(proc)
        result = summarize(runs, args.output)
        if floor is not None:
            result["floor"] = summarize(runs, args.output, "floor")
            result["vs_floor"] = {k: round(result[k] / result["floor"][k], 3) if result["floor"][k] else None
                                  for k in ("router_cpu_ms_per_token_p50", "router_cpu_ms_per_token_mean")}
            result["vs_floor"]["cpu_ms_per_token_above_floor_p50"] = round(
                result["router_cpu_ms_per_token_p50"] - result["floor"]["router_cpu_ms_per_token_p50"], 4)
        if base is not None:
            result["baseline"] = summarize(runs, args.output, "baseline")
            result["baseline"]["root"] = str(Path(args.baseline_root).resolve())
            result["same"] = summarize(runs, args.output, "same")
            mine = result["same"]
            result["vs_baseline"] = {k: round(mine[k] / result["baseline"][k], 3) if result["baseline"][k] else None
                                     for k in ("router_cpu_ms_per_token_p50", "router_cpu_ms_per_token_mean")}
            # per round: this tree's router's CPU per token over the baseline's on the request sent next to it (same
            # load, same argv)
            paired = [a / b for a, b in zip(runs["same_cpu_s"], runs["baseline_cpu_s"]) if b > 0]
            result["vs_baseline"]["cpu_ratio_paired_p50"] = round(statistics.median(paired), 3) if paired else None
            result["vs_baseline"]["added_ttft_ms_paired_p50"] = [mine["added_ttft_ms_paired_p50"],
                                                                 result["baseline"]["added_ttft_ms_paired_p50"]]
        loops = [lp for lp in args.profile_loops.split(",") if lp and args.profile_requests]
        if "uvloop" in loops and importlib.util.find_spec("uvloop") is None:
            say("uvloop is not installed: profiling on asyncio only")
            loops.remove("uvloop")
        profs = [run_profile(cluster, payload, args.profile_requests, out_dir, args.profile_timer, lp)
                 for lp in loops]
    result.update({"prompt_tokens": args.prompt, "cores": cores, "model": cfg.model, "dtype": "float32"})
    print(f"{'':<28}{'router':>12}{'direct':>12}{'added':>12}")
    for key, label in (("ttft_p50_ms", "TTFT p50 (ms)"), ("e2e_p50_ms", "e2e p50 (ms)"),
                       ("itl_p50_ms", "ITL p50 (ms)")):
        a, b = result[key]["router"], result[key]["direct"]
        print(f"{label:<28}{a:>12.2f}{b:>12.2f}{a - b:>12.2f}")
    print(f"added per streamed token: {result['added_ms_per_token']:.3f} ms (median of paired requests; from the "
          f"p50s {result['added_ms_per_token_from_p50s']:.3f} ms), e2e ratio {result['e2e_ratio']:.3f}; router "
          f"CPU {result['router_cpu_ms_per_token_p50']:.3f} ms/token (p50; mean "
          f"{result['router_cpu_ms_per_token_mean']:.3f}); TTFT added, median of paired requests "
          f"{result['added_ttft_ms_paired_p50']:.2f} ms (queue_ms p50 {result['queue_ms_p50']}); relayed tokens p50 "
          f"{result['relayed_tokens_p50']}; router_overhead_ms p50 "
          f"{result['router_overhead_ms_p50']}, client_wait_ms p50 {result['client_wait_ms_p50']}")
    if "baseline" in result:
        b = result["baseline"]
        print(f"baseline router ({b['root']}): TTFT p50 {b['ttft_p50_ms']['router']:.2f} ms (added "
              f"{b['added_ttft_ms']:.2f}; paired {b['added_ttft_ms_paired_p50']:.2f}), "
              f"e2e p50 {b['e2e_p50_ms']['router']:.2f} ms, added per token "
              f"{b['added_ms_per_token']:.3f} ms; CPU {b['router_cpu_ms_per_token_p50']:.3f} ms/token (p50; mean "
              f"{b['router_cpu_ms_per_token_mean']:.3f}); router_overhead_ms p50 {b['router_overhead_ms_p50']}")
        m = result["same"]
        print(f"this tree's router, started as the baseline: TTFT added, paired "
              f"{m['added_ttft_ms_paired_p50']:.2f} ms; CPU {m['router_cpu_ms_per_token_p50']:.3f} ms/token (p50; "
              f"mean {m['router_cpu_ms_per_token_mean']:.3f})")
        v = result["vs_baseline"]
        print(f"this tree's router / baseline (same argv), CPU per token: {v['router_cpu_ms_per_token_p50']} (p50), "
              f"{v['router_cpu_ms_per_token_mean']} (mean), {v['cpu_ratio_paired_p50']} (median of the rounds' "
              f"ratios)")
    if "floor" in result:
        f = result["floor"]
        print(f"bare asyncio relay (the floor): TTFT p50 {f['ttft_p50_ms']['router']:.2f} ms (added "
              f"{f['added_ttft_ms']:.2f}; paired {f['added_ttft_ms_paired_p50']:.2f}); "
              f"CPU {f['router_cpu_ms_per_token_p50']:.3f} ms/token (p50; mean "
              f"{f['router_cpu_ms_per_token_mean']:.3f}); this router / floor: {result['vs_floor']}")
    result["profiles"] = profs
    for prof in profs:
        print(f"\nsecond router on {prof['loop']}: CPU {prof['unprofiled_cpu_ms_per_token_p50']:.3f} ms/token "
              f"unprofiled (p50 of {prof['requests']} requests; mean {prof['unprofiled_cpu_ms_per_token_mean']:.3f}); "
              f"cProfile ({prof['timer']} clock): "
              f"{prof['busy_ms_per_token']:.3f} ms per token busy (of {prof['profiled_ms_per_token']:.3f} profiled), "
              f"pdserve code's own {prof['pdserve_code_own_ms_per_token']:.3f}")
        for name, ms in sorted(prof["groups_own_ms_per_token"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:<52}{ms:>9.4f} ms/token")
        print(f"{'function':<64}{'calls/tok':>10}{'own ms/tok':>12}{'cum ms/tok':>12}")
        for row in prof["top"]:
            print(f"{row['function'][:63]:<64}{row['calls_per_token']:>10.2f}{row['own_ms_per_token']:>12.4f}"
                  f"{row['cum_ms_per_token']:>12.4f}")
        print(f"profile: {out_dir / ('router-' + prof['loop'] + '.prof')} (python -m pstats)", file=sys.stderr)
    if len(profs) == 2:
        a, b = (p["unprofiled_cpu_ms_per_token_p50"] for p in profs)
        result["cpu_per_token_ratio"] = {f"{profs[1]['loop']}/{profs[0]['loop']}": round(b / a, 3)}
        print(f"\nrouter CPU per token, {profs[1]['loop']} / {profs[0]['loop']}: {b / a:.3f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
