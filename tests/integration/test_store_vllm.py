"""KV pool end to end with vLLM: a prefix computed once is loaded from the pool when the worker's own cache misses.

A real pool (master + one node process) and a vLLM CPU server whose PdserveConnector has ``pool_master``
set. A 1000-token prompt is served once (its 7 full blocks are saved to the pool after the request), the
same prompt is served again after the server's own prefix cache was reset (vLLM's dev endpoint, as after a
restart): the server loads the 7 blocks from the pool
(``vllm:pdserve_kv_pool_loaded_tokens_total`` = 896) and its greedy output equals the first one's. Negative control: the pooled objects are replaced with random bytes under the same keys; a
request that bypasses the local prefix cache (reset) then loads them and its output differs, so
the tokens really came from the pool's bytes. Issue 27: a byte flipped in one pooled object is caught by its seal
(that block and the ones after it are recomputed, the output stays exact, the failure is counted by path); the
negative control's random bytes carry a valid seal (this worker's fingerprint, their own checksum), or the seal would
refuse them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pdserve.hashing import block_hashes
from pdserve.launch.procs import free_port
from pdserve.store import ClientConfig, StoreClient
from pdserve.transfer import TransferConfig, TransferEngine
from pdserve.transfer.checksum import xxh3_spans
from pdserve.vllm.pool import MAGIC, SEAL_BYTES

from .corruption_tally import injected
from .test_pd_exactness import ROOT, START_TIMEOUT_S, Server, _prompt, _salt, _tokens  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]
SECRET = "pd-exactness-test-secret"
BLOCK = 128
GEN = 16


def _start_store(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_TRANSFER_SECRET=SECRET)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.store.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    assert proc.stdout.readline(), f"pdserve store {args[0]} did not start"
    return proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pdserve.launch.models import build_random_llama

    cache = os.environ.get("PDSERVE_TEST_MODEL_CACHE")
    out = Path(cache) / "random-llama-2l" if cache else tmp_path_factory.mktemp("model") / "random-llama"
    return build_random_llama(out)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    port = free_port()
    tmp = tmp_path_factory.mktemp("pool")
    procs = [_start_store("master", "--port", str(port))]
    procs.append(_start_store("node", "--master", f"127.0.0.1:{port}", "--mem", "256MiB",
                              "--disk-dir", str(tmp / "ssd"), "--disk", "256MiB", "--heartbeat-s", "0.2"))
    client = StoreClient(ClientConfig("127.0.0.1", port, secret=SECRET))
    deadline = time.time() + 10
    while client.stats()["nodes"] < 1:
        assert time.time() < deadline
        time.sleep(0.05)
    yield port, client
    client.close()
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def _wait_pooled(client: StoreClient, keys: list[int], timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not all(client.exists(keys)):
        assert time.time() < deadline, f"blocks not saved to the pool: {client.exists(keys)}"
        time.sleep(0.2)


def _wait_metric(server: Server, name: str, at_least: float, timeout: float = 20.0) -> float:
    deadline = time.time() + timeout
    value = server.metric(name)
    while value < at_least and time.time() < deadline:
        time.sleep(0.5)  # vLLM publishes connector stats with its periodic logging
        value = server.metric(name)
    return value


def _by_source(server: Server, source: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    pat = rf'^vllm:prompt_tokens_by_source_total{{[^}}]*source="{source}"[^}}]*}} ([0-9.e+-]+)$'
    return sum(float(v) for v in re.findall(pat, text, re.M))


def _metrics_text(server: Server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _read_objects(port: int, keys: list[int], size: int) -> list[np.ndarray]:
    """The pooled objects' bytes (block and seal), read through a client of our own."""
    engine = TransferEngine(TransferConfig(secret=SECRET))
    try:
        buf = np.zeros(size * len(keys), dtype=np.uint8)
        engine.register("buf", buf)
        reader = StoreClient(ClientConfig("127.0.0.1", port, secret=SECRET), engine)
        assert reader.get_into([(k, [("buf", i * size, size)]) for i, k in enumerate(keys)]) == [True] * len(keys)
        reader.close()
        return [buf[i * size:(i + 1) * size].copy() for i in range(len(keys))]
    finally:
        engine.close()


def _replace_objects(port: int, client: StoreClient, keys: list[int], objects: list[np.ndarray]) -> None:
    """Put other bytes under the same keys (objects are immutable: remove, then put)."""
    client.remove(keys)
    assert not any(client.exists(keys))
    engine = TransferEngine(TransferConfig(secret=SECRET))
    try:
        data = np.concatenate(objects)
        engine.register("data", data)
        size = len(objects[0])
        writer = StoreClient(ClientConfig("127.0.0.1", port, secret=SECRET), engine)
        assert writer.put([(k, [("data", i * size, size)]) for i, k in enumerate(keys)]) == ["stored"] * len(keys)
        writer.close()
    finally:
        engine.close()


def test_prefix_loaded_from_pool_equals_computed(model_dir, pool, tmp_path) -> None:
    port, client = pool
    extra = {"secret": SECRET, "pool_master": f"127.0.0.1:{port}"}
    prompt = _prompt(1000, seed=5)
    keys = block_hashes(prompt, BLOCK)
    assert len(keys) == 7

    server = Server(model_dir, 0, tmp_path / "server.log", extra, env_extra={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        server.wait_ready(time.monotonic() + START_TIMEOUT_S)
        computed = _tokens(server.complete(prompt, GEN))
        _wait_pooled(client, keys)
        assert _wait_metric(server, "vllm:pdserve_kv_pool_saved_blocks_total", 7) == 7
        assert server.metric("vllm:pdserve_kv_pool_save_seconds_total") > 0  # the put's own time (bench's GB/s)
        assert server.metric("vllm:pdserve_kv_pool_loaded_tokens_total") == 0
        ext0 = _by_source(server, "external_kv_transfer")

        # issue 25: the same prompt under a cache_salt is another tenant's: it loads nothing from the pool (its keys
        # start from the salt's domain) and hits nothing in the worker's own prefix cache
        hits0 = server.metric("vllm:prefix_cache_hits_total")
        server.complete(prompt, GEN, cache_salt="tenant-b")
        assert server.metric("vllm:pdserve_kv_pool_loaded_tokens_total") == 0
        assert server.metric("vllm:prefix_cache_hits_total") == hits0
        assert _by_source(server, "external_kv_transfer") == ext0

        # the worker's own prefix cache emptied (as a restarted worker's would be): the 7 full blocks come from
        # the pool
        server.reset_prefix_cache()
        local0 = _by_source(server, "local_compute")
        loaded = _tokens(server.complete(prompt, GEN))
        assert _wait_metric(server, "vllm:pdserve_kv_pool_loaded_tokens_total", 7 * BLOCK) == 7 * BLOCK
        assert server.metric("vllm:pdserve_kv_pool_load_failures_total") == 0
        assert server.metric("vllm:pdserve_kv_pool_load_seconds_total") > 0  # the get's own time (bench's GB/s)
        assert _by_source(server, "external_kv_transfer") - ext0 == 7 * BLOCK  # vLLM's own count: loaded
        assert _by_source(server, "local_compute") - local0 == 1000 - 7 * BLOCK  # ... not computed
        assert loaded == computed

        # issue 27: a byte flipped in pooled block 3 is caught by its seal: blocks 0-2 load, 3-6 are recomputed
        size = 2 * 2 * BLOCK * 2 * 64 * 4 + SEAL_BYTES  # a block of every layer (2 layers x 2 heads, fp32), the seal
        objects = _read_objects(port, keys, size)
        bad = objects[3].copy()
        bad[1000] ^= 0x10
        case = injected("pool", "byte flipped in a pool object")
        _replace_objects(port, client, keys[3:4], [bad])
        server.reset_prefix_cache()
        flipped = _tokens(server.complete(prompt, GEN))
        assert _wait_metric(server, "vllm:pdserve_kv_pool_loaded_tokens_total", 10 * BLOCK) == 10 * BLOCK
        case.done(_wait_metric(server, "vllm:pdserve_kv_checksum_failures_total", 1) == 1, flipped == computed)
        assert _wait_metric(server, "vllm:pdserve_kv_checksum_failures_total", 1) == 1
        assert 'path="pool"' in _metrics_text(server) and "KV pool block 3" in server.log_text()
        assert flipped == computed, "a corrupt pool block reached the answer"
        # the reader removed the corrupt object, recomputed the block and saved it again: the pool healed
        _wait_pooled(client, keys)
        assert np.array_equal(_read_objects(port, keys[3:4], size)[0], objects[3])

        # negative control: same keys, random bytes under a valid seal (this worker's fingerprint, the junk's own
        # checksum) -> a request that misses the local cache loads garbage, so the KV really comes from the pool
        rng = np.random.default_rng(0)
        junk = []
        for obj in objects:
            body = rng.standard_normal((size - SEAL_BYTES) // 4).astype(np.float32).view(np.uint8)
            fp = int(obj[size - SEAL_BYTES:].view(np.uint64)[1])
            seal = np.array([MAGIC | 1, fp, xxh3_spans([body])], dtype=np.uint64).view(np.uint8)
            junk.append(np.concatenate([body, seal]))
        _replace_objects(port, client, keys, junk)
        server.reset_prefix_cache()
        garbage = _tokens(server.complete(prompt, GEN))
        assert _wait_metric(server, "vllm:pdserve_kv_pool_loaded_tokens_total", 17 * BLOCK) == 17 * BLOCK
        assert garbage != computed, "output unchanged with corrupted pool blocks: the KV did not come from the pool"
    finally:
        server.stop()
