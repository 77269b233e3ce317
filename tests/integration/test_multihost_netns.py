"""pdserve across "hosts": every process in its own network namespace with its own 10.x address.

Topology (made with `ip netns` + veth pairs on a bridge that lives in a namespace of its own, so the machine's
own network is never touched):

    client 10.231.N.100 ─┐
    router 10.231.N.1   ─┼── bridge (namespace "sw")
    prefill 10.231.N.2  ─┤
    decode 10.231.N.3   ─┘

Each namespace has its own loopback, so a component that dialled 127.0.0.1 instead of the address it was
given would fail here. Tests:

- the transfer engine between two namespaces: data arrives intact, ``auto`` picks TCP (the same-host path's
  abstract Unix socket does not cross network namespaces), and the peer is reachable only at its address;
- the whole disaggregated path as the Helm chart runs it: the router starts empty in its namespace,
  pdserve.kube.discovery finds the prefill and decode workers (vLLM + pdserve connector, commands built by
  pdserve.launch, each in its own namespace) by name and adds them; greedy output through the router, from
  a client in a fourth namespace, equals the decode worker serving the request alone, and the KV moved over
  a TCP connection from the decode host to the prefill host; then pdserve.kube.drain (from the decode host, with
  the router's admin token) takes the decode worker out and discovery does not add it back.

Skipped with the reason when namespaces cannot be created (not root, no `ip`, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdserve.launch.procs import spawn, stop_children

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SECRET = "multihost-netns-test-secret-0123456789"
SUBNET = f"10.231.{20 + os.getpid() % 200}"
TRANSFER_PORT = 14579
HOSTS = {"router": 1, "prefill": 2, "decode": 3, "client": 100}


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


class Lab:
    """Network namespaces wired to one bridge; deleted (with their veths) on close."""

    def __init__(self) -> None:
        tag = f"pd{os.getpid() % 100000}"
        self.sw = f"{tag}sw"
        self.ns = {h: f"{tag}{h[:3]}" for h in HOSTS}
        self.ip = {h: f"{SUBNET}.{i}" for h, i in HOSTS.items()}
        self.made: list[str] = []
        self.etc: list[Path] = []
        try:
            self._build(tag)
        except Exception:
            self.close()
            raise

    def _build(self, tag: str) -> None:
        _run("ip", "netns", "add", self.sw)
        self.made.append(self.sw)
        _run("ip", "-n", self.sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.sw, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.ns.items()):
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            a, b = f"{tag}a{i}", f"{tag}b{i}"
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _run("ip", "link", "set", a, "netns", ns)
            _run("ip", "link", "set", b, "netns", self.sw)
            _run("ip", "-n", ns, "link", "set", a, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.sw, "link", "set", b, "master", "br0")
            _run("ip", "-n", self.sw, "link", "set", b, "up")
            # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: names resolve like a cluster's DNS
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            self.etc.append(etc)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
                f"{self.ip[h]} {h}.pd.test\n" for h in HOSTS))

    def exec(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def close(self) -> None:
        for ns in reversed(self.made):
            _run("ip", "netns", "del", ns, check=False)
        self.made.clear()
        for etc in self.etc:
            shutil.rmtree(etc, ignore_errors=True)
        if self.etc:
            try:
                Path("/etc/netns").rmdir()  # only when empty (made for this lab)
            except OSError:
                pass
        self.etc.clear()


@pytest.fixture(scope="module")
def lab():
    if os.geteuid() != 0:
        pytest.skip("multi-host test needs root to create network namespaces (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("multi-host test needs the `ip` tool (iproute2) to create network namespaces")
    try:
        lab = Lab()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield lab
    finally:
        lab.close()


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")


def py_in(lab: Lab, host: str, code: str, args: list[str], stdin: str = "", timeout: float = 120) -> dict:
    """Run a Python snippet in a host's namespace; it prints one JSON line last."""
    out = subprocess.run(lab.exec(host, [sys.executable, "-c", textwrap.dedent(code), *args]), input=stdin,
                         capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert out.returncode == 0, f"{host} snippet failed:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ transfer engine

PEER = """
import hashlib, json, sys
import numpy as np
from pdserve.transfer import TransferConfig, TransferEngine
host, secret = sys.argv[1], sys.argv[2]
eng = TransferEngine(TransferConfig(secret=secret, host=host, backend="tcp"))
mem = np.random.default_rng(5).integers(0, 256, 24 << 20, dtype=np.uint8)
eng.register("kv", mem)
print(json.dumps({"desc": eng.segment().to_wire(), "sha": hashlib.sha256(mem.tobytes()).hexdigest()}), flush=True)
for line in sys.stdin:
    if line.strip() == "notes":
        print(json.dumps([n.message.decode() for n in eng.get_notifications()]), flush=True)
    else:
        break
eng.close()
"""

INITIATOR = """
import hashlib, json, socket, sys
import numpy as np
from pdserve.transfer import SegmentDescriptor, TransferConfig, TransferEngine
host, secret, peer_host, peer_port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
desc = json.loads(sys.stdin.readline())
out = {}
for backend in ("auto", "tcp"):
    eng = TransferEngine(TransferConfig(secret=secret, host=host, backend=backend))
    dst = np.zeros(24 << 20, dtype=np.uint8)
    eng.register("dst", dst)
    peer = SegmentDescriptor.from_wire(desc)
    chosen = eng.choose_backend(peer).name
    h = eng.submit(peer, [("dst", 0, "kv", 0, dst.nbytes)], op="read", notify=b"read-" + backend.encode(),
                   deadline_s=30)
    h.result()
    out[backend] = {"chosen": chosen, "sha": hashlib.sha256(dst.tobytes()).hexdigest(),
                    "my_segment_host": eng.segment().to_wire().get("host")}
    eng.close()
# the peer is not on this host's loopback: only its 10.x address reaches it
s = socket.socket()
s.settimeout(2)
out["loopback_refused"] = s.connect_ex(("127.0.0.1", peer_port)) != 0
s.close()
print(json.dumps(out))
"""


def test_transfer_engine_between_two_hosts(lab):
    peer = subprocess.Popen(lab.exec("prefill", [sys.executable, "-c", PEER, lab.ip["prefill"], SECRET]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            start_new_session=True)
    try:
        first = json.loads(peer.stdout.readline())
        desc = first["desc"]
        wire = json.dumps(desc)
        assert lab.ip["prefill"] in wire and "127.0.0.1" not in wire, desc
        port = desc["port"]
        res = py_in(lab, "decode", INITIATOR, [lab.ip["decode"], SECRET, lab.ip["prefill"], str(port)],
                    stdin=wire + "\n")
        for backend in ("auto", "tcp"):
            assert res[backend]["sha"] == first["sha"], f"{backend}: data differs"
            assert res[backend]["chosen"] == "tcp", res  # the same-host path cannot cross network namespaces
        assert res["loopback_refused"]
        peer.stdin.write("notes\n")
        peer.stdin.flush()
        assert sorted(json.loads(peer.stdout.readline())) == ["read-auto", "read-tcp"]
    finally:
        peer.kill()
        peer.wait(timeout=10)
    # and the test process (the machine's own namespace) cannot reach the lab at all
    reach = subprocess.run([sys.executable, "-c", f"import socket; s=socket.socket(); s.settimeout(1); "
                            f"print(s.connect_ex(('{lab.ip['prefill']}', {port})))"],
                           capture_output=True, text=True, timeout=30)
    assert reach.stdout.strip() != "0"


# ------------------------------------------------------------------- router + vLLM workers

ADMIN_TOKEN = "multihost-admin-token-0123456789"

CLIENT = """
import json, random, sys, time, urllib.request
router, decode, prefill, deadline, token = sys.argv[1], sys.argv[2], sys.argv[3], time.time() + float(sys.argv[4]), sys.argv[5]

def get(url, timeout=5, auth=False):
    req = urllib.request.Request(url, headers={"Authorization": "Bearer " + token} if auth else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()

def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())

def metric(url, name):
    text = get(url + "/metrics")[1]
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(name + "{") or l.startswith(name + " "))

def members():
    return {w["url"]: w["roles"] for w in json.loads(get(router + "/v1/pdserve/workers", auth=True)[1])["workers"]}

last = ""
while True:   # discovery must add both workers (found by name), then the router turns healthy
    try:
        if members() == {prefill: ["prefill"], decode: ["decode"]} and get(router + "/health")[0] == 200:
            break
    except Exception as exc:
        last = repr(exc)
    if time.time() > deadline:
        print(json.dumps({"error": "router not ready with both workers in time: " + last}))
        sys.exit(0)
    time.sleep(2)

ids = [random.Random(7).randrange(1000, 40000) for _ in range(300)]
body = {"model": "rl", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
reads0 = metric(decode, "vllm:pdserve_kv_reads_total")
via_router = post(router + "/v1/completions", body)
reads1 = metric(decode, "vllm:pdserve_kv_reads_total")
alone = post(decode + "/v1/completions", body)
print(json.dumps({"router_text": via_router["choices"][0]["text"], "alone_text": alone["choices"][0]["text"],
                  "completion_tokens": via_router["usage"]["completion_tokens"],
                  "reads": reads1 - reads0,
                  "read_bytes": metric(decode, "vllm:pdserve_kv_read_bytes_total"),
                  "read_failures": metric(decode, "vllm:pdserve_kv_read_failures_total"),
                  "released_notified": metric(prefill, "vllm:pdserve_kv_released_notified_total")}))
"""

MEMBERS = """
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/v1/pdserve/workers", headers={"Authorization": "Bearer " + sys.argv[2]})
with urllib.request.urlopen(req, timeout=10) as r:
    print(json.dumps({w["url"]: w["roles"] for w in json.loads(r.read())["workers"]}))
"""


class NsProcess:
    def __init__(self, lab: Lab, host: str, argv: list[str], env: dict, log: Path) -> None:
        self.log_path = log
        self.child = spawn(host, lab.exec(host, argv), env=env, log_path=log, cwd=ROOT)
        self.proc = self.child.proc

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        stop_children([self.child], timeout_s=20)


@pytest.mark.vllm
def test_router_prefill_decode_on_three_hosts_with_discovery_and_drain(lab, tmp_path):
    """As on Kubernetes: the router starts empty, pdserve.kube.discovery adds the workers it finds by name,
    PD output through the router equals one worker alone with the KV read over TCP from the prefill host,
    then pdserve.kube.drain takes the decode worker out (admin token, from another host) and discovery leaves it out."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # pragma: no cover - environment
        pytest.skip(f"vllm not importable: {exc}")
    from pdserve.launch import router_env, worker_command
    from pdserve.launch.config import WorkerConfig
    from pdserve.launch.models import build_random_llama

    model = build_random_llama(tmp_path / "random-llama")
    cores = sorted(os.sched_getaffinity(0))
    workers = [
        WorkerConfig(role=role, index=0, model=str(model), port=8100, host=lab.ip[role],
                     cores=(cores[i % len(cores)],), dtype="float32", max_model_len=2048, served_model_name="rl",
                     connector_extra={"transfer_host": lab.ip[role], "transfer_port": TRANSFER_PORT,
                                      "backend": "tcp"})
        for i, role in enumerate(("prefill", "decode"))
    ]
    prefill_url, decode_url = workers[0].url, workers[1].url
    router_url = "http://router.pd.test:8000"
    admin_env = dict(_env(), PDSERVE_ADMIN_TOKEN=ADMIN_TOKEN)
    procs: list[NsProcess] = []
    conns = None
    try:
        for w in workers:
            argv, env = worker_command(w, SECRET)
            assert "127.0.0.1" not in " ".join(argv), argv
            procs.append(NsProcess(lab, w.role, argv, env, tmp_path / f"{w.role}.log"))
        rargv = [sys.executable, "-m", "pdserve.router", "--host", lab.ip["router"], "--port", "8000",
                 "--model-dir", str(model), "--mode", "disaggregated", "--served-model-name", "rl",
                 "--max-model-len", "2048", "--health-interval-s", "1"]
        procs.append(NsProcess(lab, "router", rargv, dict(router_env(), PDSERVE_ADMIN_TOKEN=ADMIN_TOKEN),
                               tmp_path / "router.log"))
        disc = NsProcess(lab, "router", [sys.executable, "-m", "pdserve.kube.discovery", "--router", router_url,
                                         "--prefill-dns", "prefill.pd.test:8100", "--decode-dns", "decode.pd.test:8100",
                                         "--interval", "1", "--absent-rounds", "2", "--tombstone", "600"],
                         admin_env, tmp_path / "discovery.log")
        procs.append(disc)
        res = subprocess.run(lab.exec("client", [sys.executable, "-c", CLIENT, router_url, decode_url, prefill_url,
                                                 "420", ADMIN_TOKEN]),
                             capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
        logs = "\n".join(f"--- {p.log_path.name}\n{p.tail()}" for p in procs)
        for p in procs:
            assert p.proc.poll() is None, f"{p.log_path.name} exited:\n{logs}"
        assert res.returncode == 0, res.stderr[-3000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert "error" not in out, out["error"] + "\n" + logs
        if shutil.which("ss"):  # the prefill host's transfer listener has a connection from the decode host
            conns = _run(*lab.exec("prefill", ["ss", "-Htn", "state", "established",
                                                f"( sport = :{TRANSFER_PORT} )"]), check=False).stdout

        # drain the decode worker from its own host, as its preStop hook would
        dr = subprocess.run(lab.exec("decode", [sys.executable, "-m", "pdserve.kube.drain", "--router", router_url,
                                                "--self", decode_url, "--timeout", "60", "--poll", "0.5"]),
                            capture_output=True, text=True, timeout=120, env=admin_env, cwd=ROOT)
        assert dr.returncode == 0, dr.stderr[-2000:]
        drained = json.loads(dr.stdout.strip().splitlines()[-1])
        time.sleep(4)  # four discovery rounds while decode.pd.test still resolves
        after = py_in(lab, "client", MEMBERS, [router_url, ADMIN_TOKEN])
        disc_log = disc.log_path.read_text(errors="replace")
    finally:
        for p in reversed(procs):
            p.stop()
    assert out["completion_tokens"] == 16
    assert out["router_text"] == out["alone_text"]  # greedy PD through the router == one worker alone
    assert out["reads"] >= 1 and out["read_failures"] == 0 and out["read_bytes"] > 0  # D read P's KV
    assert out["released_notified"] >= 1  # ... and told P, across hosts, so P freed it
    if conns is not None:
        assert lab.ip["decode"] in conns, f"no TCP connection from the decode host on :{TRANSFER_PORT}: {conns!r}"
    assert drained["idle"] and len(drained["deregistered"]) == 1 and drained["deregister_errors"] == []
    assert after == {prefill_url: ["prefill"]}, after  # drained, and not re-added from DNS
    assert "left the router while still in DNS" in disc_log, disc_log[-2000:]
