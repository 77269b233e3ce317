"""pdserve.kube.discovery: DNS -> router membership reconciliation (fake router and resolver; one real HTTP round)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.kube.discovery import (
    DiscoveryConfig,
    DiscoveryConfigError,
    HttpRouterApi,
    PoolTarget,
    Reconciler,
    RouterApiError,
    main,
    parse_members,
    resolve_addresses,
    worker_url,
)

P = PoolTarget("prefill", "pd-prefill.ns.svc", 8000)
D = PoolTarget("decode", "pd-decode.ns.svc", 8000)


class FakeRouter:
    """The router's membership API as the contract states it, in memory."""

    def __init__(self, members: dict[str, set[str]] | None = None) -> None:
        self.members = {u: set(r) for u, r in (members or {}).items()}
        self.calls: list[tuple] = []
        self.down = False

    def list_workers(self) -> dict[str, set[str]]:
        if self.down:
            raise RouterApiError("connection refused")
        return {u: set(r) for u, r in self.members.items()}

    def add_worker(self, url: str, role: str) -> None:
        self.calls.append(("add", url, role))
        self.members.setdefault(url, set()).add(role)

    def remove_worker(self, url: str) -> None:
        self.calls.append(("remove", url))
        self.members.pop(url, None)


class FakeDns:
    def __init__(self) -> None:
        self.answers: dict[str, set[str] | None] = {}

    def __call__(self, host: str, port: int) -> set[str] | None:
        return self.answers.get(host, set())


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(router: FakeRouter, dns: FakeDns, **kw) -> tuple[Reconciler, Clock]:
    clock = Clock()
    cfg = DiscoveryConfig(router="http://127.0.0.1:8000", pools=(P, D), **kw)
    return Reconciler(cfg, router, dns, clock), clock


def u(ip: str) -> str:
    return f"http://{ip}:8000"


def test_bootstrap_names_are_replaced_by_pod_addresses():
    router = FakeRouter({"http://pd-prefill.ns.svc:8000": {"prefill"}, "http://pd-decode.ns.svc:8000": {"decode"}})
    dns = FakeDns()
    dns.answers = {P.host: {"10.0.0.1", "10.0.0.2"}, D.host: {"10.0.1.1"}}
    rec, _ = make(router, dns, absent_rounds=2)
    r1 = rec.step()
    assert sorted(r1.added) == [(u("10.0.0.1"), "prefill"), (u("10.0.0.2"), "prefill"), (u("10.0.1.1"), "decode")]
    assert r1.removed == []  # the service-name entries survive one round (debounce)
    r2 = rec.step()
    assert sorted(r2.removed) == ["http://pd-decode.ns.svc:8000", "http://pd-prefill.ns.svc:8000"]
    assert router.members == {u("10.0.0.1"): {"prefill"}, u("10.0.0.2"): {"prefill"}, u("10.0.1.1"): {"decode"}}
    assert not rec.step().changed  # steady state: no calls


def test_scale_up_adds_at_once_and_scale_down_waits_absent_rounds():
    router = FakeRouter()
    dns = FakeDns()
    dns.answers = {P.host: {"10.0.0.1"}, D.host: {"10.0.1.1"}}
    rec, _ = make(router, dns, absent_rounds=3)
    rec.step()
    dns.answers[D.host] = {"10.0.1.1", "10.0.1.2"}
    assert rec.step().added == [(u("10.0.1.2"), "decode")]
    dns.answers[D.host] = {"10.0.1.2"}
    assert rec.step().removed == []
    assert rec.step().removed == []
    assert rec.step().removed == [u("10.0.1.1")]
    assert set(router.members) == {u("10.0.0.1"), u("10.0.1.2")}


def test_a_flapping_address_resets_its_absence_count():
    router = FakeRouter()
    dns = FakeDns()
    dns.answers = {P.host: {"10.0.0.1"}, D.host: {"10.0.1.1"}}
    rec, _ = make(router, dns, absent_rounds=2)
    rec.step()
    dns.answers[P.host] = set()
    rec.step()
    dns.answers[P.host] = {"10.0.0.1"}
    rec.step()
    dns.answers[P.host] = set()
    assert rec.step().removed == []  # absent once again, not twice in a row
    assert rec.step().removed == [u("10.0.0.1")]


def test_dns_failure_changes_nothing_for_that_role():
    router = FakeRouter()
    dns = FakeDns()
    dns.answers = {P.host: {"10.0.0.1"}, D.host: {"10.0.1.1"}}
    rec, _ = make(router, dns, absent_rounds=1)
    rec.step()
    dns.answers[P.host] = None  # SERVFAIL / timeout
    dns.answers[D.host] = set()  # NXDOMAIN: decode pool scaled to zero
    res = rec.step()
    assert res.unresolved == ["prefill"]
    assert res.removed == [u("10.0.1.1")]
    assert u("10.0.0.1") in router.members


def test_drained_worker_is_not_resurrected_until_it_leaves_dns_or_the_tombstone_expires():
    router = FakeRouter()
    dns = FakeDns()
    dns.answers = {P.host: {"10.0.0.1", "10.0.0.2"}, D.host: {"10.0.1.1"}}
    rec, clock = make(router, dns, tombstone_s=60)
    rec.step()
    router.members.pop(u("10.0.0.1"))  # its preStop drain DELETEd it; DNS still lists it (stale)
    clock.t = 5
    res = rec.step()
    assert res.tombstoned == [u("10.0.0.1")] and res.added == []
    clock.t = 30
    assert rec.step().added == []
    clock.t = 70  # tombstone expired and it still resolves: it is a live worker again
    assert rec.step().added == [(u("10.0.0.1"), "prefill")]


def test_tombstone_clears_when_the_address_leaves_dns_so_a_reused_ip_is_added():
    router = FakeRouter()
    dns = FakeDns()
    dns.answers = {P.host: {"10.0.0.1"}, D.host: {"10.0.1.1"}}
    rec, clock = make(router, dns, tombstone_s=600)
    rec.step()
    router.members.pop(u("10.0.1.1"))
    rec.step()
    dns.answers[D.host] = set()
    rec.step()
    dns.answers[D.host] = {"10.0.1.1"}  # a new pod got the same IP
    assert rec.step().added == [(u("10.0.1.1"), "decode")]


def test_router_restart_re_adds_everything_instead_of_tombstoning():
    router = FakeRouter()
    dns = FakeDns()
    dns.answers = {P.host: {"10.0.0.1"}, D.host: {"10.0.1.1"}}
    rec, _ = make(router, dns)
    rec.step()
    router.members = {"http://pd-prefill.ns.svc:8000": {"prefill"}, "http://pd-decode.ns.svc:8000": {"decode"}}
    res = rec.step()
    assert res.tombstoned == []
    assert sorted(res.added) == [(u("10.0.0.1"), "prefill"), (u("10.0.1.1"), "decode")]


def test_router_down_is_reported_and_nothing_else_happens():
    router = FakeRouter()
    router.down = True
    rec, _ = make(router, FakeDns())
    res = rec.step()
    assert "connection refused" in res.error and not res.changed and router.calls == []


def test_colocated_members_are_left_alone():
    router = FakeRouter({u("10.9.9.9"): {"colocated"}})
    dns = FakeDns()
    dns.answers = {P.host: set(), D.host: set()}
    rec, _ = make(router, dns, absent_rounds=1)
    rec.step()
    rec.step()
    assert router.members == {u("10.9.9.9"): {"colocated"}}


def test_config_errors_say_how_to_fix():
    with pytest.raises(DiscoveryConfigError, match="NAME:PORT"):
        PoolTarget.parse("prefill", "pd-prefill")
    with pytest.raises(DiscoveryConfigError, match="base URL"):
        DiscoveryConfig(router="127.0.0.1:8000", pools=(P,))
    with pytest.raises(DiscoveryConfigError, match="--prefill-dns"):
        DiscoveryConfig(router="http://127.0.0.1:8000", pools=())
    assert main(["--router", "http://x:1", "--prefill-dns", "nope"]) == 2


def test_parse_members_and_urls():
    assert parse_members({"workers": [{"url": "http://a:1/", "role": "prefill"},
                                      {"url": "http://b:1", "roles": ["prefill", "decode"]}]}) == \
        {"http://a:1": {"prefill"}, "http://b:1": {"prefill", "decode"}}
    with pytest.raises(RouterApiError):
        parse_members({"workers": [{"nourl": 1}]})
    assert worker_url("fd00::5", 8000) == "http://[fd00::5]:8000"
    assert worker_url("10.0.0.5", 8000) == "http://10.0.0.5:8000"


def test_resolve_addresses_tells_no_such_name_from_a_failure(monkeypatch):
    found = resolve_addresses("localhost", 80)
    assert found and found <= {"127.0.0.1", "::1"}

    def fail(errno):
        def getaddrinfo(*a, **k):
            raise socket.gaierror(errno, "test")
        return getaddrinfo

    monkeypatch.setattr(socket, "getaddrinfo", fail(socket.EAI_NONAME))
    assert resolve_addresses("pool.ns.svc", 80) == set()  # no ready pod: an empty pool
    monkeypatch.setattr(socket, "getaddrinfo", fail(socket.EAI_AGAIN))
    assert resolve_addresses("pool.ns.svc", 80) is None  # DNS trouble: judge nothing this round


class _MembershipHandler(BaseHTTPRequestHandler):
    """A router membership API over real HTTP, as in the contract."""

    members: dict[str, set[str]] = {}

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def _reply(self, code: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._reply(200, {"workers": [{"url": k, "roles": sorted(v), "healthy": True}
                                      for k, v in self.members.items()]})

    def do_POST(self) -> None:  # noqa: N802
        b = self._body()
        if b["role"] in self.members.get(b["url"], ()):
            return self._reply(409, {"error": "already a member"})
        self.members.setdefault(b["url"], set()).add(b["role"])
        self._reply(200, {"ok": True})

    def do_DELETE(self) -> None:  # noqa: N802
        b = self._body()
        if b["url"] not in self.members:
            return self._reply(404, {"error": "not a member"})
        del self.members[b["url"]]
        self._reply(200, {"ok": True})

    def log_message(self, *args) -> None:
        pass


def test_http_router_api_round_trip_through_the_cli():
    _MembershipHandler.members = {"http://127.0.0.9:8000": {"decode"}}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _MembershipHandler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        api = HttpRouterApi(base)
        api.add_worker("http://127.0.0.8:8000", "prefill")
        api.add_worker("http://127.0.0.8:8000", "prefill")  # 409 is fine
        api.remove_worker("http://nope:1")  # 404 is fine
        assert api.list_workers() == {"http://127.0.0.8:8000": {"prefill"}, "http://127.0.0.9:8000": {"decode"}}
        # the CLI with real DNS: localhost resolves, so it is added as a prefill worker
        assert main(["--router", base, "--prefill-dns", "localhost:8123", "--once"]) == 0
        roles = {k: v for k, v in _MembershipHandler.members.items() if "8123" in k}
        assert roles and all(v == {"prefill"} for v in roles.values())
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(RouterApiError, match="GET"):
        HttpRouterApi(base, timeout_s=0.5).list_workers()  # the server is gone


def test_a_router_refusing_connections_raises_quickly():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(RouterApiError):
        HttpRouterApi(f"http://127.0.0.1:{port}", timeout_s=0.5).list_workers()
