"""pdserve.kube.discovery and pdserve.kube.drain against the real router's membership API (no vLLM: the workers are
small HTTP servers answering /health and /metrics like vLLM does; the router process is the real one)."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdserve.kube.discovery import DiscoveryConfig, HttpRouterApi, PoolTarget, Reconciler, RouterApiError
from pdserve.kube.drain import DrainConfig, drain
from tests.integration.conftest import membership_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "discovery-test-admin-token-0123456789"
METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="rl"} %d
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="rl"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="rl"} 0.0
"""


class FakeWorker:
    """/health 200 and vLLM-like /metrics; `running` requests until `busy_scrapes` scrapes have been served."""

    def __init__(self, busy_scrapes: int = 0) -> None:
        self.scrapes = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/metrics":
                    outer.scrapes += 1
                    body = (METRICS % (1 if outer.scrapes <= busy_scrapes else 0)).encode()
                elif self.path in ("/health", "/v1/models"):
                    body = b'{"data": [{"id": "rl"}]}' if self.path == "/v1/models" else b""
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    yield from membership_router(tmp_path_factory, "disc", TOKEN, 0)


def test_discovery_and_drain_against_the_real_router(router, monkeypatch):
    p, d1, d2 = FakeWorker(), FakeWorker(busy_scrapes=3), FakeWorker()
    try:
        # "DNS": the pool names resolve to 127.0.0.1; each worker is told apart by its port
        answers = {"prefill.pool": {"127.0.0.1"}, "decode.pool": {"127.0.0.1"}}
        pools = (PoolTarget("prefill", "prefill.pool", p.port), PoolTarget("decode", "decode.pool", d1.port))
        cfg = DiscoveryConfig(router=router, pools=pools, absent_rounds=1, tombstone_s=600)
        api = HttpRouterApi(router, token=TOKEN)
        rec = Reconciler(cfg, api, resolver=lambda host, port: answers[host])
        res = rec.step()
        assert not res.error and sorted(res.added) == sorted([(p.url, "prefill"), (d1.url, "decode")])
        assert api.list_workers() == {p.url: {"prefill"}, d1.url: {"decode"}}
        assert not rec.step().changed

        # without the token the router refuses, and says how to fix it
        with pytest.raises(RouterApiError, match="PDSERVE_ADMIN_TOKEN"):
            HttpRouterApi(router, token="").list_workers()

        # a request is running on d1: drain waits for it, then the router no longer lists d1
        monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", TOKEN)
        out = drain(DrainConfig(routers=(router,), self_url=d1.url, timeout_s=30, poll_s=0.1))
        assert out.idle and out.deregistered == [router] and d1.scrapes >= 5, out
        assert api.list_workers() == {p.url: {"prefill"}}
        # d1 still "resolves": discovery does not add it back
        res = rec.step()
        assert res.tombstoned == [d1.url] and res.added == []
        assert api.list_workers() == {p.url: {"prefill"}}
        # scale-out: the decode pool's name now points at another worker
        rec.config = DiscoveryConfig(router=router, pools=(pools[0], PoolTarget("decode", "decode.pool", d2.port)),
                                     absent_rounds=1, tombstone_s=600)
        res = rec.step()
        assert res.added == [(d2.url, "decode")]
        with urllib.request.urlopen(router + "/health", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())
    finally:
        for w in (p, d1, d2):
            w.close()
