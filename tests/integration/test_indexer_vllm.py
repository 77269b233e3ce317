"""The KV indexer service (``pdserve indexer``) on real vLLM workers' KV events (issue 39): it runs next to the
2P1D conductor stack (two router replicas, the pool), subscribed to the same publishers; under traffic it takes a
snapshot, is killed with SIGKILL, misses batches while down and restarts from the snapshot. It must then resume
every worker's stream from the snapshot's own batch (no clear, no re-learning), and its view must equal the
routers' (which never stopped) and the workers' truth: a prompt it says worker W holds N blocks of hits exactly
N blocks of W's vLLM prefix cache."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.prom import scrape

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
]

BLOCK = 128
ROOT = Path(__file__).resolve().parents[2]


def _post(url: str, body: Any, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


class Indexer:
    """``python -m pdserve.indexer`` as its own process (own session, killed in ``stop``)."""

    def __init__(self, entries: list[str], snap: Path, log: Path) -> None:
        from pdserve.launch.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "pdserve.indexer", "--indexer-port", str(self.port),
                     "--indexer-snapshot", str(snap), "--indexer-snapshot-interval-s", "0",
                     *[a for e in entries for a in ("--kv-events", e)]]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(self.url + "/health")
                return
            except (urllib.error.URLError, ConnectionError):
                assert self.proc.poll() is None, f"indexer exited: {self.log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "indexer did not answer /health in 60 s"
                time.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Traffic(threading.Thread):
    """Requests through the router: prompts of three shared prefixes (2-6 blocks) and their own tails."""

    def __init__(self, router: str, n: int) -> None:
        super().__init__(daemon=True)
        rng = random.Random(39)
        families = [[rng.randrange(1000, 30000) for _ in range(6 * BLOCK)] for _ in range(3)]
        self.prompts = []
        for i in range(n):
            fam = families[i % 3][:BLOCK * rng.randrange(2, 7)]
            self.prompts.append(fam + [rng.randrange(1000, 30000) for _ in range(rng.randrange(20, 2 * BLOCK))])
        self.router, self.done, self.failed = router, 0, 0

    def run(self) -> None:
        for p in self.prompts:
            try:
                _post(self.router + "/v1/completions", {"model": "rl", "prompt": p, "max_tokens": 2,
                                                        "temperature": 0})
            except Exception:
                self.failed += 1
            self.done += 1

    def wait_for(self, n: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.done < n:
            assert time.monotonic() < deadline, f"only {self.done} of {n} requests done in {timeout_s} s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(pd_conductor):
    return pd_conductor  # tests/integration/conftest.py: 2P1D, two router replicas, the pool, one LoRA adapter


def _device_blocks(view: dict) -> dict[str, int]:
    return {w: t.get("device", 0) for w, t in view["blocks"].items() if w != "pool"}


def _router_blocks(router: str) -> dict[str, int]:
    body = _get(router + "/v1/pdserve/workers")
    return {w["url"]: w.get("indexed_blocks", 0) for w in body["workers"]}


# Back on the test command: its 1-in-3 failure (one stream cleared after the restart: replayed 16, duplicates 2,
# clears 1) was the feed reading a batch's live copy, arriving after its replayed copy, as a restarted publisher
# (fixed in kv_events.py; tests/unit/test_indexer_snapshot.py reproduces both orders of replay and live).
def test_indexer_killed_under_traffic_resumes_exactly(cluster, tmp_path):
    from pdserve.launch.commands import kv_publisher_entry

    entries = [kv_publisher_entry(w) for w in cluster.plan.workers if w.kv_events_endpoint]
    assert len(entries) == 3
    router = cluster.router_url
    ix = Indexer(entries, tmp_path / "index.snap", tmp_path / "indexer.log")
    traffic = Traffic(router, 18)
    try:
        ix.start()
        traffic.start()
        traffic.wait_for(5)
        snap = _post(ix.url + "/snapshot", {})
        assert snap["bytes"] > 0 and snap["blocks"] > 0
        traffic.wait_for(8)
        ix.kill()  # no final snapshot: what it applied after the snapshot is lost with it
        traffic.wait_for(11)  # batches published while it is down reach it only through the replay buffers
        ix.start()
        view = _get(ix.url + "/global_view")
        assert view["snapshot"]["restored_blocks"] == snap["blocks"]
        traffic.join(600)
        assert traffic.failed == 0
        # its view settles on the routers' (they never stopped), worker by worker
        deadline = time.monotonic() + 60
        while True:
            view = _get(ix.url + "/global_view")
            mine, theirs = _device_blocks(view), _router_blocks(router)
            if all(mine.get(w, 0) == n for w, n in theirs.items()) and sum(theirs.values()) > 0:
                break
            assert time.monotonic() < deadline, f"indexer {mine} != routers {theirs}"
            time.sleep(0.5)
        # resumed from the snapshot's batches, not re-learned: no stream was cleared, each replayed from its point
        assert view["counters"]["clears"] == 0, view["counters"]
        assert view["counters"]["replayed"] > 0
        # the workers' truth: what it says a prefill worker holds of a prompt is what that worker's cache hits
        checked = 0
        for p in traffic.prompts[-3:]:
            found = _post(ix.url + "/query", {"model": "rl", "token_ids": p})["default"]
            for w in cluster.worker_urls("prefill"):
                held = found.get(w, {}).get("device", 0)
                before = scrape(w, "vllm:prefix_cache_hits_total").get("vllm:prefix_cache_hits_total", 0.0)
                _post(w + "/v1/completions", {"model": "rl", "prompt": p, "max_tokens": 1, "temperature": 0}, 300)
                after = scrape(w, "vllm:prefix_cache_hits_total").get("vllm:prefix_cache_hits_total", 0.0)
                assert after - before == held, f"{w}: indexer said {held} tokens, vLLM hit {after - before}"
                checked += held > 0
        assert checked > 0, "no prompt was held anywhere: nothing was compared"
    finally:
        ix.stop()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ext_proc(port: int, body: dict) -> dict[str, str]:
    """What a gateway does: one ext-proc stream (Envoy's published definitions), headers then the buffered body;
    returns the headers the picker set (the destination, and P for a P -> D placement)."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    hs = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json")]
    msgs = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]))),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(body).encode(), end_of_stream=True))]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        out = list(pb_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=60))
    assert out[-1].WhichOneof("response") == "request_body", out[-1]
    meta = out[-1].dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    got = {h.header.key: h.header.raw_value.decode() for h in out[-1].request_body.response.header_mutation.set_headers}
    assert got["x-gateway-destination-endpoint"] == meta.string_value
    return got


def _sidecar_argv(cluster, port: int) -> list[str]:
    """pdserve's router as the decode worker's sidecar (--prefiller-header): the one D, the prefill pool."""
    return [sys.executable, "-m", "pdserve.router", "--model-dir", str(cluster.model_dir), "--served-model-name", "rl",
            "--max-model-len", "2048", "--prefill", *cluster.worker_urls("prefill"),
            "--decode", *cluster.worker_urls("decode"), "--prefiller-header", "--host", "127.0.0.1",
            "--port", str(port), "--no-calibrate"]


def _post_with(url: str, body: Any, headers: dict[str, str]) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _prompt_tokens(url: str, source: str = "") -> float:
    """A worker's prompt tokens (vLLM's counters): all, or those of one source (external_kv_transfer: read from P)."""
    if not source:
        return sum(scrape(url, "vllm:prompt_tokens_total").values())
    return sum(v for k, v in scrape(url, "vllm:prompt_tokens_by_source_total", labels=True).items()
               if f'source="{source}"' in k)


def _through_sidecar(cluster, side: str, picker_port: int) -> None:
    """The gateway's two steps for a prompt no worker holds: the picker (ext-proc) names P and D, then the request,
    with the picker's headers, goes to the picked D's sidecar (this test's router --prefiller-header beside the
    stack's one D). P computes the prompt (its prompt-token counter grows by it, no other P's), D reads P's KV (its
    external_kv_transfer tokens grow) and the answer is one worker's (D alone, asked afterwards), token for token.
    A header naming a host outside the prefill pool is never dialled: the whole request on D, the same tokens."""
    ps, d = cluster.worker_urls("prefill"), cluster.worker_urls("decode")[0]
    rng = random.Random(41)
    prompt = [rng.randrange(1000, 30000) for _ in range(3 * BLOCK + 17)]
    body = {"model": "rl", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    picked = _ext_proc(picker_port, body)
    assert "http://" + picked["x-gateway-destination-endpoint"] == d  # the sidecar is the one beside this D
    p = "http://" + picked["x-prefiller-host-port"]
    before = {u: _prompt_tokens(u) for u in ps}
    read = _prompt_tokens(d, "external_kv_transfer")
    out = _post_with(side + "/v1/completions", body, {"x-prefiller-host-port": picked["x-prefiller-host-port"]})
    assert _prompt_tokens(p) - before[p] >= len(prompt)  # P prefilled it ...
    assert all(_prompt_tokens(u) == before[u] for u in ps if u != p)  # ... and no other P
    assert _prompt_tokens(d, "external_kv_transfer") > read  # D read P's KV
    m = scrape(side, "pdserve_router_", labels=True)
    assert m.get('pdserve_router_sidecar_pairs_total{outcome="pair"}') == 1.0, m
    assert sum(v for k, v in m.items() if k.startswith("pdserve_router_handoffs_total") and (
        'outcome="kv"' in k or 'outcome="early"' in k)) >= 1, m
    want = _post(d + "/v1/completions", body)["choices"][0]["token_ids"]  # one worker's answer
    assert out["choices"][0]["token_ids"] == want
    before = {u: _prompt_tokens(u) for u in ps}
    out = _post_with(side + "/v1/completions", body, {"x-prefiller-host-port": "169.254.169.254:80"})
    assert out["choices"][0]["token_ids"] == want
    assert all(_prompt_tokens(u) == before[u] for u in ps)  # no P asked
    m = scrape(side, "pdserve_router_sidecar_pairs_total", labels=True)
    assert m.get('pdserve_router_sidecar_pairs_total{outcome="unknown_host"}') == 1.0, m


def test_pickers_active_active_pick_endpoints_that_serve(cluster, tmp_path):
    """Two pickers (no leader) seeded from one indexer and following the same workers place the same prefix on
    the same prefill worker; the picked P and D serve the request end to end: P's one-token prefill, then D with
    P's kv_transfer_params (what llm-d's decode sidecar does), and through pdserve's router as the picked D's
    sidecar (--prefiller-header, with the picker's headers), token for token what the router answers; and the
    picked D alone, as a gateway without a sidecar sends it, answers the same."""
    from pdserve.launch.commands import kv_publisher_entry
    from pdserve.launch.ports import free_port

    entries = [kv_publisher_entry(w) for w in cluster.plan.workers if w.kv_events_endpoint]
    ix = Indexer(entries, tmp_path / "index.snap", tmp_path / "indexer.log")
    pickers: list[subprocess.Popen] = []
    side_port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(tmp_path / "sidecar.log", "ab") as log:  # first: its start-up overlaps the indexer's and the pickers'
        sidecar = subprocess.Popen(_sidecar_argv(cluster, side_port), stdout=log, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
    try:
        ix.start()
        ports = [free_port(), free_port()]
        for i, port in enumerate(ports):
            argv = [sys.executable, "-m", "pdserve.picker", "--model-dir", str(cluster.model_dir),
                    "--prefill", *cluster.worker_urls("prefill"), "--decode", *cluster.worker_urls("decode"),
                    "--kv-events", *entries, "--indexer", ix.url, "--local-prefill-tokens", "0",
                    "--picker-host", "127.0.0.1", "--picker-port", str(port), "--routers", "2"]
            with open(tmp_path / f"picker{i}.log", "ab") as log:
                pickers.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True))
        side = f"http://127.0.0.1:{side_port}"
        started = [(proc, port, f"picker{i}") for i, (proc, port) in enumerate(zip(pickers, ports))]
        for proc, port, name in [*started, (sidecar, side_port, "sidecar")]:  # up (transformers: slow to import)
            deadline = time.monotonic() + 240
            while not _listening(port):
                assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"the {name} did not listen in 240 s"
                time.sleep(0.5)
        rng = random.Random(40)
        prefix = [rng.randrange(1000, 30000) for _ in range(5 * BLOCK)]
        outs = []
        for i, port in enumerate(ports):
            prompt = prefix + [300 + i] * 20
            got = _ext_proc(port, {"model": "rl", "prompt": prompt, "max_tokens": 6})
            p = "http://" + got["x-prefiller-host-port"]
            d = "http://" + got["x-gateway-destination-endpoint"]
            assert p in cluster.worker_urls("prefill") and d in cluster.worker_urls("decode")
            first = _post(p + "/v1/completions", {"model": "rl", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                  "return_token_ids": True,
                                                  "kv_transfer_params": {"do_remote_decode": True,
                                                                         "lease_on_stop": False}})
            t1 = first["choices"][0]["token_ids"][0]
            rest = _post(d + "/v1/completions", {"model": "rl", "prompt": prompt + [t1], "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                                 "kv_transfer_params": first["kv_transfer_params"]})
            alone = _post(cluster.router_url + "/v1/completions",
                          {"model": "rl", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                           "return_token_ids": True})
            assert [t1] + rest["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
            # a gateway without the sidecar: the request as the client sent it, to the picked D alone, which
            # serves it whole (its own prefill): the same tokens
            whole = _post(d + "/v1/completions", {"model": "rl", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True})
            assert whole["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
            outs.append(p)
            if i == 0:  # the second picker learns P's blocks from P's own events before it places the same prefix
                deadline = time.monotonic() + 30
                while _post(ix.url + "/query", {"model": "rl", "token_ids": prompt})["default"].get(p, {}).get(
                        "device", 0) < 5 * BLOCK and time.monotonic() < deadline:
                    time.sleep(0.2)
                time.sleep(1.0)
        assert outs[0] == outs[1], "the second picker did not follow the prefix the first one placed"
        _through_sidecar(cluster, side, ports[0])
    finally:
        for proc in [*pickers, sidecar]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        ix.stop()
