"""The Kubernetes path of supervision: a worker pod restarts (Kubernetes restarts the container; while it is not
ready its address leaves the pool's headless Service) and the discovery sidecar removes it from, then adds it back
to, a real router's membership, under the same address or under a new pod IP. No vLLM: the workers are small HTTP
servers answering /health and /metrics like vLLM; the router is the real process; "DNS" is the resolver the
Reconciler is given (127.0.0.1 and 127.0.0.2 stand for two pod IPs)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdserve.http_probe import http_status
from pdserve.kube.discovery import DiscoveryConfig, HttpRouterApi, PoolTarget, Reconciler
from tests.integration.conftest import membership_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "supervision-discovery-admin-token-0123"
METRICS = b"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="rl"} 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="rl"} 0
"""


class Pod:
    """A worker pod's HTTP server on ``host:port`` (/health 200, vLLM-like /metrics)."""

    def __init__(self, host: str, port: int = 0) -> None:
        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = METRICS if self.path == "/metrics" else b""
                self.send_response(200 if self.path in ("/health", "/metrics") else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.srv = ThreadingHTTPServer((host, port), H)
        self.host, self.port = host, self.srv.server_address[1]
        self.url = f"http://{host}:{self.port}"
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def crash(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    yield from membership_router(tmp_path_factory, "sup-disc", TOKEN, 0.5)


def _ready(router: str) -> tuple[int | None, dict]:
    try:
        import urllib.request

        with urllib.request.urlopen(router + "/ready", timeout=5) as r:
            return r.status, json.loads(r.read())
    except Exception as e:  # HTTPError carries the 503 body
        code = getattr(e, "code", None)
        body = json.loads(e.read()) if code else {}  # type: ignore[attr-defined]
        return code, body


def test_a_restarted_pod_is_removed_and_re_added_under_the_same_or_a_new_address(router):
    p = Pod("127.0.0.1")
    d = Pod("127.0.0.1")
    d_port = d.port
    dns: dict[str, set[str]] = {"prefill.pool": {"127.0.0.1"}, "decode.pool": {"127.0.0.1"}}
    cfg = DiscoveryConfig(router=router, pools=(PoolTarget("prefill", "prefill.pool", p.port),
                                                PoolTarget("decode", "decode.pool", d_port)),
                          absent_rounds=2, tombstone_s=600)
    api = HttpRouterApi(router, token=TOKEN)
    rec = Reconciler(cfg, api, resolver=lambda host, port: set(dns[host]))
    pods = [p, d]
    try:
        assert sorted(rec.step().added) == sorted([(p.url, "prefill"), (d.url, "decode")])
        assert _ready(router)[0] == 200

        # the decode container crashes; Kubernetes restarts it; not ready meanwhile: gone from the Service
        d.crash()
        dns["decode.pool"] = set()
        assert rec.step().removed == []  # one round missing removes nobody (a DNS hiccup) ...
        res = rec.step()
        assert res.removed == [d.url] and res.tombstoned == []  # ... two do
        assert api.list_workers() == {p.url: {"prefill"}}
        status, body = _ready(router)  # the prefill worker serves whole requests meanwhile: degraded, not down
        assert status == 200 and body["status"] == "degraded" and body["missing"] == ["decode"]

        # the same pod comes back (same IP, same port) and is ready again: added back at once
        d = Pod("127.0.0.1", d_port)
        pods.append(d)
        dns["decode.pool"] = {"127.0.0.1"}
        assert rec.step().added == [(d.url, "decode")]
        assert api.list_workers() == {p.url: {"prefill"}, d.url: {"decode"}}
        assert _ready(router)[0] == 200 and _ready(router)[1]["status"] == "ready"

        # it crashes again and is rescheduled as a new pod with a new IP (same container port)
        d.crash()
        new = Pod("127.0.0.2", d_port)
        pods.append(new)
        dns["decode.pool"] = {"127.0.0.2"}
        res = rec.step()
        assert res.added == [(new.url, "decode")] and res.removed == []  # the new one at once
        res = rec.step()
        assert res.removed == [d.url]  # the old one after absent_rounds
        assert api.list_workers() == {p.url: {"prefill"}, new.url: {"decode"}}
        # the router's health probes agree: every member healthy, ready
        deadline = time.monotonic() + 10
        while http_status(router + "/health") != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http_status(router + "/health") == 200
        status, body = _ready(router)
        assert status == 200 and (body["healthy_workers"], body["workers"]) == (2, 2)
    finally:
        for pod in pods:
            try:
                pod.crash()
            except OSError:
                pass
        for url in api.list_workers():
            api.remove_worker(url)
