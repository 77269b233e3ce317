"""pdserve.kube.drain against real HTTP servers on 127.0.0.1: two router replicas and a worker's /metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdserve.kube.drain import DrainConfig, DrainConfigError, busy_counts, drain, parse_prometheus, router_targets

ROOT = Path(__file__).resolve().parents[2]

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %(running)s
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} %(waiting)s
# TYPE vllm:pdserve_kv_reads_total counter
vllm:pdserve_kv_reads_total{engine="0",model_name="m"} 12.0
# HELP vllm:pdserve_kv_reads_created KV reads completed by this decode worker
# TYPE vllm:pdserve_kv_reads_created gauge
vllm:pdserve_kv_reads_created{engine="0",model_name="m"} 1.7959861089365299e+09
%(extra)s"""


class Server:
    """A real HTTP server whose handler is a function (method, path, body) -> (status, body bytes)."""

    def __init__(self, handle) -> None:
        outer = self

        class H(BaseHTTPRequestHandler):
            def _go(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                status, data = handle(self.command, self.path, body, dict(self.headers))
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_DELETE = do_POST = _go

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        outer.calls = []

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


class Worker:
    """Serves vLLM-like /metrics; `running` drops by one per scrape after `finish_after` scrapes."""

    def __init__(self, running: int, waiting: int = 0, finish_after: int = 2, extra: str = "") -> None:
        self.running, self.waiting, self.finish_after, self.extra = running, waiting, finish_after, extra
        self.scrapes = 0
        self.server = Server(self.handle)

    def handle(self, method, path, body, headers=None):
        assert path == "/metrics"
        self.scrapes += 1
        if self.scrapes > self.finish_after:
            if self.waiting:
                self.waiting -= 1
            elif self.running:
                self.running -= 1
        text = VLLM_METRICS % {"running": float(self.running), "waiting": float(self.waiting),
                               "extra": self.extra}
        return 200, text.encode()


class Router:
    def __init__(self, members: set[str], token: str = "") -> None:
        self.members = set(members)
        self.deletes: list[str] = []
        self.token = token
        self.server = Server(self.handle)

    def handle(self, method, path, body, headers=None):
        assert path == "/v1/pdserve/workers" and method == "DELETE"
        if self.token and (headers or {}).get("Authorization") != f"Bearer {self.token}":
            return 401, b'{"error": "needs the admin token"}'
        url = json.loads(body)["url"]
        self.deletes.append(url)
        if url not in self.members:
            return 404, b'{"error": "not a member"}'
        self.members.discard(url)
        return 200, b'{"ok": true}'


@pytest.fixture
def servers():
    made = []
    yield made
    for s in made:
        s.server.close()


def test_drain_deregisters_from_every_router_then_waits_for_idle(servers):
    w = Worker(running=2, waiting=1, finish_after=2)
    r1, r2 = Router({w.server.url}), Router(set())  # r2 never had it: 404 counts as done
    servers += [w, r1, r2]
    cfg = DrainConfig(routers=(r1.server.url, r2.server.url), self_url=w.server.url, timeout_s=20, poll_s=0.05)
    t0 = time.monotonic()
    res = drain(cfg)
    assert res.idle, res.message
    assert r1.deletes == [w.server.url] and r2.deletes == [w.server.url] and r1.members == set()
    assert sorted(res.deregistered) == sorted([r1.server.url, r2.server.url]) and res.deregister_errors == []
    # 2 busy scrapes, 3 finishing (waiting 1 -> 0, running 2 -> 0), 1 more quiet one: it waited for them
    assert w.scrapes == 6 and res.last_busy["vllm:num_requests_running"] == 0
    assert time.monotonic() - t0 < 10


def test_router_host_is_resolved_to_every_replica(servers):
    w = Worker(running=0)
    r1, r2 = Router({w.server.url}), Router({w.server.url})
    servers += [w, r1, r2]
    # the two replicas are "behind one name": resolve() maps it to both (on 127.0.0.1, distinct ports
    # cannot share a name, so each is named once and resolved to the same address)
    targets = router_targets(r1.server.url, resolve=lambda host, port: ["127.0.0.1"])
    assert targets == [r1.server.url]
    assert router_targets("http://no-such-router.invalid:8000", resolve=lambda h, p: []) == \
        ["http://no-such-router.invalid:8000"]
    assert router_targets("http://pd-router-peers:8000", resolve=lambda h, p: ["10.0.0.2", "10.0.0.1"]) == \
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    res = drain(DrainConfig(routers=(r1.server.url, r2.server.url), self_url=w.server.url, poll_s=0.05))
    assert res.idle and r1.members == set() and r2.members == set()


def test_timeout_reports_what_is_still_busy(servers):
    w = Worker(running=3, finish_after=10_000)
    r = Router({w.server.url})
    servers += [w, r]
    res = drain(DrainConfig(routers=(r.server.url,), self_url=w.server.url, timeout_s=0.5, poll_s=0.05))
    assert not res.idle and "still busy" in res.message and "num_requests_running" in res.message


def test_connector_kv_gauges_must_reach_zero_and_replace_the_blind_hold(servers):
    held = {"n": 3}

    def metrics(method, path, body, headers=None):
        held["n"] = max(0, held["n"] - 1)
        extra = f"# TYPE vllm:pdserve_kv_leases_held gauge\nvllm:pdserve_kv_leases_held{{engine=\"0\"}} {held['n']}\n"
        return 200, (VLLM_METRICS % {"running": 0.0, "waiting": 0.0, "extra": extra}).encode()

    w = Server(metrics)
    r = Router(set())
    servers += [r]
    try:
        slept = []
        res = drain(DrainConfig(routers=(r.server.url,), self_url=w.url, hold_s=30, poll_s=0.01),
                    sleep=lambda s: (slept.append(s), time.sleep(min(s, 0.01))))
        assert res.idle and res.held_s == 0.0 and res.last_busy["vllm:pdserve_kv_leases_held"] == 0
        assert 30 not in slept
    finally:
        w.close()


def test_hold_applies_without_a_kv_gauge(servers):
    w = Worker(running=0)
    r = Router({w.server.url})
    servers += [w, r]
    slept = []
    res = drain(DrainConfig(routers=(r.server.url,), self_url=w.server.url, hold_s=35, poll_s=0.01),
                sleep=slept.append)
    assert res.idle and res.held_s == 35 and slept[-1] == 35


def test_a_dead_worker_has_nothing_to_drain_and_a_dead_router_is_reported(servers):
    w = Worker(running=0)
    r = Router(set())
    servers += [w, r]
    dead_url = r.server.url
    r.server.close()
    servers.remove(r)
    res = drain(DrainConfig(routers=(dead_url,), self_url=w.server.url, poll_s=0.01))
    assert res.idle and res.deregister_errors and res.deregistered == []
    w.server.close()
    servers.remove(w)
    res = drain(DrainConfig(routers=(dead_url,), self_url=w.server.url, poll_s=0.01))
    assert res.idle and "unreachable" in res.message


def test_the_admin_token_comes_from_the_environment(servers, monkeypatch):
    w = Worker(running=0)
    r = Router({w.server.url}, token="t0ken")
    servers += [w, r]
    monkeypatch.delenv("PDSERVE_ADMIN_TOKEN", raising=False)
    res = drain(DrainConfig(routers=(r.server.url,), self_url=w.server.url, poll_s=0.01))
    assert res.deregistered == [] and "401" in res.deregister_errors[0]
    assert "PDSERVE_ADMIN_TOKEN" in res.deregister_errors[0] and r.members == {w.server.url}
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "t0ken")
    res = drain(DrainConfig(routers=(r.server.url,), self_url=w.server.url, poll_s=0.01))
    assert res.deregistered == [r.server.url] and r.members == set()


def test_parse_prometheus_and_busy_counts():
    sums, types = parse_prometheus(VLLM_METRICS % {"running": 2.0, "waiting": 1.0, "extra": ""})
    assert sums["vllm:num_requests_running"] == 2 and types["vllm:num_requests_waiting"] == "gauge"
    busy, has_kv = busy_counts(VLLM_METRICS % {"running": 0.0, "waiting": 0.0, "extra": ""})
    # counters, and the "_created" timestamps prometheus_client types as gauges, are not held KV
    assert busy == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0} and not has_kv
    with pytest.raises(ValueError, match="vLLM"):
        busy_counts("up 1\n")


def test_config_errors():
    with pytest.raises(DrainConfigError, match="--router"):
        DrainConfig(routers=(), self_url="http://10.0.0.1:8000")
    with pytest.raises(DrainConfigError, match="base URL"):
        DrainConfig(routers=("http://r:8000",), self_url="10.0.0.1:8000")
    with pytest.raises(DrainConfigError, match="hold"):
        DrainConfig(routers=("http://r:8000",), self_url="http://10.0.0.1:8000", hold_s=-1)


def test_cli_exit_codes(servers):
    w = Worker(running=1, finish_after=10_000)
    r = Router({w.server.url})
    servers += [w, r]
    cmd = [sys.executable, "-m", "pdserve.kube.drain", "--router", r.server.url, "--self", w.server.url,
           "--timeout", "0.5", "--poll", "0.05"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1 and "still busy" in out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["idle"] is False
    w.running = 0
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    bad = subprocess.run([sys.executable, "-m", "pdserve.kube.drain", "--router", "r", "--self", "x"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "base URL" in bad.stderr
