"""Fault injection under steady load: kill -9 a P, a D, the pool node and the router, SIGSTOP a worker for 10 s.

    python benchmarks/chaos_bench.py --quick            # ~60 s of load (plus start-up, recovery and drain)
    python benchmarks/chaos_bench.py --quick --routers 2   # two router replicas on one port; one is killed
    python benchmarks/chaos_bench.py --duration 180 --rate 1.5 --prefill 1 --decode 2 --seed 7

A stack of at least three vLLM workers (default 1P2D, a tiny random Llama from pdserve.launch.models, fp32) plus the KV
pool and the router is started through the launcher (`pdserve serve`, a real subprocess: its supervisor restarts
what dies). First an undisturbed reference: every prompt once, greedy, straight to one worker. Then a Poisson
load of streamed greedy completions through the router for ``--duration`` seconds, while the faults fire at
random times (one per slot of the load window, in random order; seeded). Each request ends as one of:

- ``correct``: the stream finished and its text equals the reference;
- ``wrong``: the stream finished with another text (must be 0);
- ``clear error``: an HTTP error with an OpenAI-style JSON body, or an SSE error event;
- ``refused``: the router's port refused the connection (the router itself was dead: nothing was started);
- ``cut``: the connection broke mid-response (the router was killed while streaming it);
- ``hung``: no end within ``--client-timeout`` (must be 0).

After the load: wait until every in-flight request has ended, until full service (the router's /health is 200
and the launcher says every process is up), and until every worker holds no KV block (``vllm:kv_cache_usage_perc``
x the worker's block count, from its /metrics; the connector exposes counters only, read as context); then
SIGTERM the launcher and check it restarted nothing while stopping and left no process. "Time until full
service" for a fault: from the fault until the first sample, after the faulted process was restarted (the
launcher's ``pdserve_process_restarts_total`` went up) or SIGCONT'ed, at which there was full service; faults
may overlap, so one recovery can include another fault's. "Back" is the faulted process alone: restarted and
healthy (the launcher's ``pdserve_process_up``), or SIGCONT'ed and its /health answering. Migrations: read
from the router's /metrics (any ``*migrat*`` counter) or a response header naming them; "n/a" when the router
exposes neither.

With ``--routers N`` (N > 1) the launch runs N router processes on one port (``pdserve serve --routers N``) and
``kill_router`` kills the last one. Every replica names itself in the ``X-Pdserve-Replica`` response header, so
each failed request is counted as one the killed replica was serving (it had answered with its headers, which a
stream sends with its first token), one that no replica had answered yet, or one elsewhere; the unanswered ones
are split by time: sent before a kill and broken at it (the killed replica had accepted the connection, or it
was still in that replica's accept queue), sent after a kill (must be 0), other. Every failed request is listed.
Whether the kernel resets the connections waiting in a killed listener's accept queue or hands them to another
replica is ``net.ipv4.tcp_migrate_req`` (reported; docs/conductor.md, "Router replicas").

Prints a table, then a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pdserve.http_probe import http_status  # noqa: E402
from pdserve.launch.procs import pids_in_group, wait_dead  # noqa: E402
from pdserve.prom import families  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("kill_prefill", "kill_decode", "kill_pool_node", "kill_router", "stop_worker")


# --------------------------------------------------------------------------- small HTTP helpers


def get_text(url: str, timeout_s: float = 3.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def samples(text: str | None) -> list[tuple[str, dict[str, str], float]]:
    out: list[tuple[str, dict[str, str], float]] = []
    for _, _, ss in families(text or ""):
        out += [(s.name, dict(s.labels), float(s.value)) for s in ss]
    return out


def launcher_metric(stack: Stack, name: str, process: str) -> float | None:
    for n, labels, v in samples(get_text(stack.manifest()["metrics_url"] + "/metrics")):
        if n == name and labels.get("process") == process:
            return v
    return None


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


# --------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    """`pdserve serve` as a subprocess; its launch.json is re-read whenever a pid is needed (restarts change them)."""

    proc: subprocess.Popen
    run_dir: Path
    err_path: Path

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "launch.json").read_text())

    def pid(self, name: str) -> int:
        m = self.manifest()
        if name == "router" and "routers" not in m:
            return int(m["router"]["pid"])
        for entry in m["workers"] + m["pool"] + m.get("routers", []):
            if entry["name"] == name:
                return int(entry["pid"])
        raise KeyError(name)

    def pgids(self) -> list[int]:
        m = self.manifest()
        routers = [int(e["pid"]) for e in m["routers"]] if "routers" in m else [int(m["router"]["pid"])]
        return [int(e["pid"]) for e in m["workers"] + m["pool"]] + routers


def start_stack(args: argparse.Namespace, model: Path, run_dir: Path) -> Stack:
    err_path = run_dir.parent / "launcher.err"
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(model), "--prefill", str(args.prefill),
            "--decode", str(args.decode), "--port", "0", "--run-dir", str(run_dir), "--dtype", "float32",
            "--lease-s", str(args.lease_s), "--worker-timeout", str(args.startup_timeout),
            "--router-args=--health-interval-s 1", "--routers", str(args.routers)]
    with open(err_path, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(ROOT),
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    if "pdserve is serving" not in banner:
        proc.kill()
        proc.wait()
        raise SystemExit(f"pdserve serve did not start:\n{err_path.read_text()[-4000:]}")
    return Stack(proc, run_dir, err_path)


def stop_stack(stack: Stack) -> dict[str, Any]:
    """SIGTERM the launcher; it must stop everything and restart nothing meanwhile."""
    pgids = stack.pgids()
    before = len(stack.err_path.read_text().splitlines())
    t0 = time.monotonic()
    stack.proc.send_signal(signal.SIGTERM)
    try:
        rc = stack.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        stack.proc.kill()
        rc = stack.proc.wait()
    stop_s = time.monotonic() - t0
    tail = stack.err_path.read_text().splitlines()[before:]
    left = wait_dead([p for g in pgids for p in pids_in_group(g)], 30.0)
    return {"launcher_exit": rc, "stop_s": round(stop_s, 1), "processes_left": len(left),
            "restarts_during_stop": sum(1 for line in tail if "restarted " in line)}


# --------------------------------------------------------------------------- load


@dataclass
class Outcome:
    prompt: int
    sent_at: float
    kind: str = ""  # correct | wrong | clear_error | refused | cut | hung
    detail: str = ""
    migrated: bool = False
    replica: int | None = None  # the router replica that answered (X-Pdserve-Replica), None before any did
    ended_at: float = 0.0  # seconds into the load
    chars: int = 0  # text received before it ended


def make_prompts(n: int, rng: random.Random, vocab: int = 49152) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 96))] for _ in range(n)]


def reference(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    out = []
    for p in prompts:
        r = post_json(url + "/v1/completions", {"model": model, "prompt": p, "max_tokens": max_tokens,
                                                "temperature": 0})
        out.append(r["choices"][0]["text"])
    return out


async def one_request(session: Any, url: str, model: str, idx: int, prompt: list[int], max_tokens: int,
                      expected: str, timeout_s: float, t0: float) -> Outcome:
    o = Outcome(idx, time.monotonic() - t0)
    try:
        return await _stream_one(session, url, model, prompt, max_tokens, expected, timeout_s, o)
    finally:
        o.ended_at = time.monotonic() - t0


async def _stream_one(session: Any, url: str, model: str, prompt: list[int], max_tokens: int, expected: str,
                      timeout_s: float, o: Outcome) -> Outcome:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, done, error = "", False, ""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", json=body) as resp:
                o.migrated = any("migrat" in k.lower() and v not in ("", "0") for k, v in resp.headers.items())
                replica = resp.headers.get("X-Pdserve-Replica", "")
                o.replica = int(replica) if replica.isdigit() else None
                if resp.status != 200:
                    raw = await resp.read()
                    try:
                        msg = json.loads(raw)["error"]["message"]
                        o.kind, o.detail = "clear_error", f"{resp.status}: {msg}"
                    except (ValueError, KeyError, TypeError):
                        o.kind, o.detail = "cut", f"{resp.status} without a JSON error body"
                    return o
                async for line in resp.content:
                    s = line.decode("utf-8", "replace").strip()
                    if not s.startswith("data:"):
                        continue
                    data = s[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = str(chunk["error"].get("message", chunk["error"]))
                        continue
                    for c in chunk.get("choices", []):
                        text += c.get("text") or ""
                        o.chars = len(text)
    except TimeoutError:
        o.kind, o.detail = "hung", f"no end within {timeout_s:g} s"
        return o
    except aiohttp.ClientConnectorError as e:
        o.kind, o.detail = "refused", f"{type(e).__name__}: {e}"
        return o
    except (aiohttp.ClientError, ConnectionError, OSError) as e:
        o.kind, o.detail = "cut", f"{type(e).__name__}: {e}"
        return o
    if error:
        o.kind, o.detail = "clear_error", f"error event: {error}"
    elif not done:
        o.kind, o.detail = "cut", "stream ended without [DONE]"
    else:
        o.kind = "correct" if text == expected else "wrong"
        if o.kind == "wrong":
            o.detail = f"got {text!r}, expected {expected!r}"
    return o


# --------------------------------------------------------------------------- faults and the monitor


@dataclass
class Fault:
    kind: str
    at_s: float  # seconds into the load
    target: str = ""
    fired_at: float | None = None  # monotonic
    cont_at: float | None = None
    restarts_before: float = 0.0
    recovered_s: float | None = None
    back_s: float | None = None
    note: str = ""
    pid: int = 0
    fired_s: float | None = None  # seconds into the load


def plan_faults(duration_s: float, rng: random.Random) -> list[Fault]:
    kinds = list(FAULTS)
    rng.shuffle(kinds)
    lo, hi = 0.1 * duration_s, 0.8 * duration_s
    slot = (hi - lo) / len(kinds)
    return [Fault(k, round(lo + i * slot + rng.uniform(0, slot * 0.8), 1)) for i, k in enumerate(kinds)]


def target_of(kind: str, args: argparse.Namespace) -> str:
    return {"kill_prefill": "prefill0", "kill_decode": "decode0", "kill_pool_node": "pool-node",
            "kill_router": f"router{args.routers - 1}" if args.routers > 1 else "router",
            "stop_worker": f"decode{args.decode - 1}" if args.decode > 1 else "prefill0"
            }[kind]


async def inject(stack: Stack, faults: list[Fault], t0: float, stop_s: float, log: list[str]) -> None:
    for f in sorted(faults, key=lambda f: f.at_s):
        await asyncio.sleep(max(0.0, t0 + f.at_s - time.monotonic()))
        pid = f.pid = stack.pid(f.target)
        f.restarts_before = launcher_metric(stack, "pdserve_process_restarts_total", f.target) or 0.0
        f.fired_at = time.monotonic()
        f.fired_s = f.fired_at - t0
        if f.kind == "stop_worker":
            os.killpg(pid, signal.SIGSTOP)  # the whole worker: API server and engine core (pid leads its group)
            log.append(f"{f.fired_at - t0:6.1f} s  SIGSTOP {f.target} (pid {pid}) for {stop_s:g} s")
            await asyncio.sleep(stop_s)
            os.killpg(pid, signal.SIGCONT)
            f.cont_at = time.monotonic()
            log.append(f"{f.cont_at - t0:6.1f} s  SIGCONT {f.target}")
        else:
            os.kill(pid, signal.SIGKILL)
            log.append(f"{f.fired_at - t0:6.1f} s  kill -9 {f.target} (pid {pid})")


def full_service(stack: Stack) -> bool:
    if http_status(stack.manifest()["router_url"] + "/health", timeout_s=3.0) != 200:
        return False
    text = get_text(stack.manifest()["metrics_url"] + "/metrics")
    ups = [v for n, _, v in samples(text) if n == "pdserve_process_up"]
    return bool(ups) and all(v == 1 for v in ups)


def process_back(stack: Stack, f: Fault, now: float) -> bool:
    """The faulted process alone serves again: SIGCONT'ed and answering /health, or restarted and up."""
    if f.kind == "stop_worker":
        url = next(w["url"] for w in stack.manifest()["workers"] if w["name"] == f.target)
        return f.cont_at is not None and now >= f.cont_at and http_status(url + "/health", timeout_s=2.0) == 200
    restarts = launcher_metric(stack, "pdserve_process_restarts_total", f.target)
    up = launcher_metric(stack, "pdserve_process_up", f.target)
    return restarts is not None and restarts > f.restarts_before and up == 1


async def monitor(stack: Stack, faults: list[Fault], until: dict[str, float]) -> None:
    """Sample full service every 0.5 s; a fault recovers at the first full-service sample after its process came
    back (restarted, or SIGCONT'ed). Ends once the load is over (``until`` gets a deadline) and every fired fault
    recovered, or at that deadline."""
    while time.monotonic() < until["deadline"]:
        if until["deadline"] < float("inf") and all(f.recovered_s is not None for f in faults if f.fired_at):
            return
        now = time.monotonic()
        ok = await asyncio.to_thread(full_service, stack)
        for f in faults:
            if f.fired_at is None or f.recovered_s is not None:
                continue
            back = await asyncio.to_thread(process_back, stack, f, now)
            if back and f.back_s is None:
                f.back_s = round(now - f.fired_at, 1)
            if back and ok:
                f.recovered_s = round(now - f.fired_at, 1)
        await asyncio.sleep(0.5)


# --------------------------------------------------------------------------- drain: KV still held


def held_blocks(url: str) -> dict[str, float] | None:
    ss = samples(get_text(url + "/metrics"))
    if not ss:
        return None
    usage = sum(v for n, _, v in ss if n == "vllm:kv_cache_usage_perc")
    blocks = max((float(lb.get("num_gpu_blocks", 0) or 0) for n, lb, _ in ss if n == "vllm:cache_config_info"),
                 default=0.0)
    out = {"held_blocks": round(usage * max(blocks - 1, 0)), "kv_usage": usage,
           "running": sum(v for n, _, v in ss if n == "vllm:num_requests_running"),
           "waiting": sum(v for n, _, v in ss if n == "vllm:num_requests_waiting")}
    for key in ("released_notified", "released_lease", "reads", "read_failures"):
        out[key] = sum(v for n, _, v in ss if n == f"vllm:pdserve_kv_{key}_total")
    return out


def wait_kv_free(stack: Stack, timeout_s: float) -> dict[str, dict[str, float] | None]:
    deadline = time.monotonic() + timeout_s
    while True:
        held = {w["name"]: held_blocks(w["url"]) for w in stack.manifest()["workers"]}
        clean = all(h is not None and h["held_blocks"] == 0 and h["running"] == 0 for h in held.values())
        if clean or time.monotonic() > deadline:
            return held
        time.sleep(1.0)


def migrations_from_router(stack: Stack) -> float | None:
    ss = samples(get_text(stack.manifest()["router_url"] + "/metrics"))
    found = [v for n, _, v in ss if "migrat" in n and n.endswith("_total")]
    return sum(found) if found else None


# --------------------------------------------------------------------------- main


async def run_load(stack: Stack, args: argparse.Namespace, prompts: list[list[int]], expected: list[str],
                   faults: list[Fault], log: list[str]) -> tuple[list[Outcome], float]:
    import aiohttp

    rng = random.Random(args.seed + 1)
    m = stack.manifest()
    url, model = m["router_url"], m["model_name"]
    until = {"deadline": float("inf")}
    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        mon = asyncio.create_task(monitor(stack, faults, until))
        inj = asyncio.create_task(inject(stack, faults, t0, args.stop_s, log))
        tasks: list[asyncio.Task[Outcome]] = []
        next_at = 0.0
        while True:
            next_at += rng.expovariate(args.rate)
            if next_at > args.duration:
                break
            await asyncio.sleep(max(0.0, t0 + next_at - time.monotonic()))
            i = rng.randrange(len(prompts))
            tasks.append(asyncio.create_task(one_request(session, url, model, i, prompts[i], args.max_tokens,
                                                         expected[i], args.client_timeout, t0)))
        await inj
        outcomes = list(await asyncio.gather(*tasks))
        drained_at = time.monotonic() - t0
        log.append(f"{drained_at:6.1f} s  load done: {len(outcomes)} requests ended")
        until["deadline"] = time.monotonic() + args.recovery_timeout
        await mon
    return outcomes, drained_at


def build_model(args: argparse.Namespace, tmp: Path) -> Path:
    if args.model:
        return Path(args.model)
    from pdserve.launch.models import build_random_llama

    return build_random_llama(tmp / "tiny-llama", layers=2, hidden=256)


def split_unanswered(unanswered: list[Outcome], kills: list[float], window_s: float = 2.0
                     ) -> dict[str, list[Outcome]]:
    """Failed requests no replica had answered (a stream's headers go out with its first token), by when:
    ``at_the_kill``: sent before a router kill and ended within ``window_s`` after it (the killed replica had
    accepted it, or it sat in that replica's accept queue); ``after``: sent after a kill (must not fail because
    of it: the kernel no longer hands new connections to a closed listener); ``other``."""
    out: dict[str, list[Outcome]] = {"at_the_kill": [], "after": [], "other": []}
    for o in unanswered:
        if any(o.sent_at <= k <= o.ended_at <= k + window_s for k in kills):
            out["at_the_kill"].append(o)
        elif any(o.sent_at > k for k in kills):
            out["after"].append(o)
        else:
            out["other"].append(o)
    return out


def tcp_migrate_req() -> int | None:
    """net.ipv4.tcp_migrate_req (Linux 5.14+): 1 moves the connections waiting in a closed (or killed) listener's
    accept queue to another listener of its SO_REUSEPORT group; 0 (the default) resets them."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_migrate_req").read_text())
    except (OSError, ValueError):
        return None


def report(args: argparse.Namespace, outcomes: list[Outcome], faults: list[Fault], held: dict[str, Any],
           stop: dict[str, Any], restarts: dict[str, float | None], migrations: float | None,
           log: list[str]) -> dict[str, Any]:
    kinds = ("correct", "wrong", "clear_error", "refused", "cut", "hung")
    by = {k: [o for o in outcomes if o.kind == k] for k in kinds}
    killed = {f.pid for f in faults if f.kind == "kill_router" and f.fired_at is not None}
    kills = [f.fired_s for f in faults if f.kind == "kill_router" and f.fired_s is not None]
    failed = [o for o in outcomes if o.kind not in ("correct", "wrong")]
    on_killed = [o for o in failed if o.replica in killed]
    unanswered = [o for o in failed if o.replica is None]
    elsewhere = [o for o in failed if o.replica is not None and o.replica not in killed]
    split = split_unanswered(unanswered, kills)
    held_total = sum(int(h["held_blocks"]) for h in held.values() if h is not None)
    header_migrated = sum(1 for o in by["correct"] if o.migrated)
    migrated: Any = header_migrated if header_migrated or migrations is not None else "n/a"
    result = {
        "bench": "chaos", "duration_s": args.duration,
        "topology": f"{args.prefill}P{args.decode}D" + (f", {args.routers} routers" if args.routers > 1 else ""),
        "rate_rps": args.rate, "max_tokens": args.max_tokens, "seed": args.seed,
        "requests_sent": len(outcomes), "completed_correct": len(by["correct"]),
        "completed_after_migration": migrated, "router_migrations_total": migrations,
        "failed_clear_error": len(by["clear_error"]), "failed_refused": len(by["refused"]),
        "failed_cut": len(by["cut"]),
        "hung": len(by["hung"]), "wrong_output": len(by["wrong"]), "routers": args.routers,
        "correct_pct": round(100.0 * len(by["correct"]) / max(1, len(outcomes)), 1),
        "failed_on_killed_replica": len(on_killed), "failed_before_a_replica_answered": len(unanswered),
        "failed_unanswered_at_the_kill": len(split["at_the_kill"]),
        "failed_unanswered_sent_after_the_kill": len(split["after"]),
        "failed_unanswered_other": len(split["other"]), "failed_elsewhere": len(elsewhere),
        "router_kill_at_s": [round(k, 1) for k in kills], "tcp_migrate_req": tcp_migrate_req(),
        "kv_blocks_held_after_drain": held_total,
        "kv_held_per_worker": {n: (None if h is None else int(h["held_blocks"])) for n, h in held.items()},
        "lease_expiries": sum(h["released_lease"] for h in held.values() if h is not None),
        "faults": [{"fault": f.kind, "target": f.target, "at_s": f.at_s, "back_after_s": f.back_s,
                    "full_service_after_s": f.recovered_s} for f in faults],
        "restarts": restarts, **stop,
    }
    print("\nevents:")
    for line in log:
        print("  " + line)
    errors = sorted({o.detail[:110] for o in by["clear_error"] + by["refused"] + by["cut"]})
    if errors:
        print("distinct errors (first 8):")
        for e in errors[:8]:
            print("  " + e)
    if failed:
        print("failed requests (sent / ended: seconds into the load; replica: the pid that answered):")
        for o in sorted(failed, key=lambda o: o.sent_at):
            where = ("killed replica" if o.replica in killed else "no replica answered" if o.replica is None
                     else "live replica")
            print(f"  prompt {o.prompt:>3}  sent {o.sent_at:6.1f}  ended {o.ended_at:6.1f}  {o.kind:<11} {where:<19}"
                  f" {o.chars:>3} chars in  {o.detail[:70]}")
    for o in by["wrong"][:3]:
        print(f"  WRONG prompt {o.prompt} at {o.sent_at:.1f} s: {o.detail[:200]}")
    rows = [("requests sent", len(outcomes)), ("completed correctly", len(by["correct"])),
            ("  of which after a migration", migrated), ("failed with a clear error", len(by["clear_error"])),
            ("failed: refused (router down)", len(by["refused"])),
            ("failed: cut mid-response (router killed)", len(by["cut"])), ("hung (must be 0)", len(by["hung"])),
            ("wrong output (must be 0)", len(by["wrong"])),
            ("failed: served by the killed router replica", len(on_killed)),
            ("failed: before any router replica answered", len(unanswered)),
            ("  of which sent before a router kill, ended at it", len(split["at_the_kill"])),
            ("  of which sent after a router kill (must be 0)", len(split["after"])),
            ("failed: on a live router replica", len(elsewhere)),
            ("KV blocks held after drain (must be 0)", held_total)]
    def secs(v: float | None) -> str:
        return "not within the wait" if v is None else f"{v:.1f} s"

    rows += [(f"{f.kind} ({f.target} @ {f.at_s:.0f} s): back / full service",
              f"{secs(f.back_s)} / {secs(f.recovered_s)}") for f in faults]
    rows += [("launcher restarts", ", ".join(f"{k}={v:g}" for k, v in restarts.items() if v)),
             ("restarts during SIGTERM stop (must be 0)", stop["restarts_during_stop"]),
             ("processes left after stop (must be 0)", stop["processes_left"])]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'chaos bench, ' + result['topology'] + ', ' + str(args.duration) + ' s load':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 s of load (the default duration is 120 s)")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds of load (60-180; default 120, quick 60)")
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests per second (1.0)")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--routers", type=int, default=1, help="router processes on the one port (kill_router kills "
                                                           "the last)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=24, help="distinct prompts (each run once for the reference)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-s", type=float, default=10.0, help="how long the SIGSTOPped worker stays stopped")
    ap.add_argument("--client-timeout", type=float, default=120.0, help="a request not ended by then is 'hung'")
    ap.add_argument("--lease-s", type=float, default=15.0, help="prefill workers' KV lease (pdserve serve --lease-s)")
    ap.add_argument("--recovery-timeout", type=float, default=300.0, help="longest wait for full service")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--model", default="", help="model folder (default: a tiny random Llama, fp32)")
    args = ap.parse_args()
    args.duration = args.duration or (60.0 if args.quick else 120.0)
    if args.prefill + args.decode < 3 or args.prefill < 1 or args.decode < 1:
        ap.error("use at least three workers, with at least one prefill and one decode (e.g. 1P2D or 2P1D)")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp_name:
        tmp = Path(tmp_name)
        model = build_model(args, tmp)
        print(f"[chaos] starting {args.prefill}P{args.decode}D through `pdserve serve` ...", file=sys.stderr,
              flush=True)
        t_start = time.monotonic()
        logs = ROOT / ".pdserve" / "chaos" / time.strftime("%Y%m%d-%H%M%S")
        logs.mkdir(parents=True, exist_ok=True)
        stack = start_stack(args, model, logs / "run")
        try:
            print(f"[chaos] stack up in {time.monotonic() - t_start:.0f} s; reference run on one worker",
                  file=sys.stderr, flush=True)
            m = stack.manifest()
            prompts = make_prompts(args.prompts, rng)
            expected = reference(m["workers"][0]["url"], m["model_name"], prompts, args.max_tokens)
            faults = plan_faults(args.duration, rng)
            for f in faults:
                f.target = target_of(f.kind, args)
            log: list[str] = []
            print(f"[chaos] {args.duration:g} s of load at {args.rate:g} req/s; faults at "
                  + ", ".join(f"{f.at_s:g} s {f.kind}" for f in sorted(faults, key=lambda f: f.at_s)),
                  file=sys.stderr, flush=True)
            outcomes, _ = asyncio.run(run_load(stack, args, prompts, expected, faults, log))
            held = wait_kv_free(stack, args.lease_s + 30.0)
            names = ([w["name"] for w in m["workers"]] + [p["name"] for p in m["pool"]]
                     + [r["name"] for r in m.get("routers", [{"name": "router"}])])
            restarts = {n: launcher_metric(stack, "pdserve_process_restarts_total", n) for n in names}
            migrations = migrations_from_router(stack)
        finally:
            stop = stop_stack(stack)
        result = report(args, outcomes, faults, held, stop, restarts, migrations, log)
        print(f"logs: {stack.err_path} (launcher) and {stack.run_dir} (every process)", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
