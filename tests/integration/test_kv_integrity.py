"""Issue 27, end to end: injected KV corruption never reaches an answer.

One stack, started once: a KV pool (master + node processes) and two vLLM CPU workers P and D (fp32 random Llama,
PdserveConnector with ``kv_checksum`` on by default and test faults allowed). Each case injects one fault, checks
that it was detected (the read's stats, the log, ``vllm:pdserve_kv_checksum_failures_total`` by path, or the
refusal naming the field) and that greedy output still equals one worker's own:

* a byte flipped in transit (``flip``: D flips a byte of a received block before its check);
* a late write into P's leased block after P sealed it, before D reads (``late``, given to P);
* D given a P of another model or dtype (P's fingerprint in kv_transfer_params altered: the same check a real P of
  another model meets, without starting a third vLLM server);
* a byte flipped in a KV pool object (rewritten in the pool under the same key).
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import pytest

from pdserve.hashing import block_hashes, domain_root
from pdserve.procs import free_port
from pdserve.store import ClientConfig, StoreClient

from .test_pd_exactness import START_TIMEOUT_S, Server, _prompt, _salt, _tokens, _wait_usage_zero
from .test_store_vllm import _read_objects, _replace_objects, _start_store, _wait_pooled

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]
SECRET = "pd-exactness-test-secret"
GEN = 12
BLOCK = 128
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 4  # 2 layers x 2 KV heads x 128 tokens x (K+V) 2x64 x fp32
PROMPT = 700  # 6 blocks, the last partial


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pdserve.models import build_random_llama

    cache = os.environ.get("PDSERVE_TEST_MODEL_CACHE")
    out = cache and os.path.join(cache, "random-llama-2l")
    return build_random_llama(out or tmp_path_factory.mktemp("model") / "random-llama")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    port = free_port()
    tmp = tmp_path_factory.mktemp("integrity")
    procs = [_start_store("master", "--port", str(port))]
    procs.append(_start_store("node", "--master", f"127.0.0.1:{port}", "--mem", "128MiB", "--heartbeat-s", "0.2"))
    client = StoreClient(ClientConfig("127.0.0.1", port, secret=SECRET))
    extra = {"secret": SECRET, "lease_s": 30, "allow_test_faults": True, "pool_master": f"127.0.0.1:{port}"}
    p = Server(model_dir, 0, tmp / "p.log", extra)
    d = Server(model_dir, 1 if (os.cpu_count() or 1) > 1 else 0, tmp / "d.log", extra,
               env_extra={"VLLM_SERVER_DEV_MODE": "1"})  # reset_prefix_cache: the pool case misses D's own cache
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        p.wait_ready(deadline)
        d.wait_ready(deadline)
        yield p, d, port, client
    finally:
        p.stop()
        d.stop()
        client.close()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _failures(server: Server, path: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    pat = rf'^vllm:pdserve_kv_checksum_failures_total{{[^}}]*path="{path}"[^}}]*}} ([0-9.e+-]+)$'
    return sum(float(v) for v in re.findall(pat, text, re.M))


def _wait_failures(server: Server, path: str, at_least: float, timeout: float = 20.0) -> float:
    end = time.monotonic() + timeout
    value = _failures(server, path)
    while value < at_least and time.monotonic() < end:
        time.sleep(0.5)  # vLLM publishes connector stats with its periodic logging
        value = _failures(server, path)
    return value


def _case(stack, seed: int, p_fault: str = "", d_fault: str = "", fingerprint: dict | None = None):
    """Colocated reference on D, then P -> D with the fault; (reference, P -> D tokens, D's read stats)."""
    p, d, _, _ = stack
    prompt = _prompt(PROMPT, seed)
    reference = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    pparams = {"do_remote_decode": True, **({"pdserve_test_fault": p_fault} if p_fault else {})}
    pr = p.complete(prompt, 1, kv_transfer_params=pparams)
    params = dict(pr["kv_transfer_params"])
    assert params["remote_fingerprint"]["dtype"] == "float32", params
    if d_fault:
        params["pdserve_test_fault"] = d_fault
    if fingerprint:
        params["remote_fingerprint"] = {**params["remote_fingerprint"], **fingerprint}
    if p_fault == "late":
        time.sleep(0.5)  # P's worker sealed the lease and then wrote into its block
    dr = d.complete(prompt + _tokens(pr), GEN - 1, kv_transfer_params=params, cache_salt=_salt())
    return reference, _tokens(pr) + _tokens(dr), dr["kv_transfer_params"]["pdserve"]


def test_clean_handoff_is_verified(stack):
    reference, tokens, stats = _case(stack, seed=1)
    assert stats["ok"] and stats["verified"] == -(-PROMPT // BLOCK), stats
    assert tokens == reference


def test_byte_flipped_in_transit_is_recomputed(stack):
    p, d, _, _ = stack
    before = _failures(d, "p2p")
    reference, tokens, stats = _case(stack, seed=2, d_fault="flip")
    assert not stats["ok"] and "differ from P's checksums" in stats["error"], stats
    assert tokens == reference, "a corrupt block reached the answer"
    assert _wait_failures(d, "p2p", before + 1) == before + 1
    assert "KV checksum failure" in d.log_text()
    assert _wait_usage_zero(p, 10.0) <= 1e-9  # P still freed its blocks


def test_late_write_into_p_block_is_recomputed(stack):
    p, d, _, _ = stack
    before = _failures(d, "p2p")
    reference, tokens, stats = _case(stack, seed=3, p_fault="late")
    assert not stats["ok"] and "differ from P's checksums" in stats["error"], stats
    assert "pdserve_test_fault=late" in p.log_text()
    assert tokens == reference
    assert _wait_failures(d, "p2p", before + 1) == before + 1


@pytest.mark.parametrize("field, value", [("model_hash", "0123456789abcdef"), ("dtype", "bfloat16")])
def test_p_of_another_model_or_dtype_is_refused_by_field(stack, field, value):
    p, _, _, _ = stack
    reference, tokens, stats = _case(stack, seed=4 + len(field), fingerprint={field: value})
    assert not stats["ok"] and stats["refused"].startswith(f"fingerprint mismatch: {field}: P='{value}'"), stats
    assert tokens == reference
    assert _wait_usage_zero(p, 10.0) <= 1e-9  # D told P to free the blocks it refused


def test_byte_flipped_in_a_pool_object_is_a_miss(stack):
    _, d, port, client = stack
    prompt = _prompt(1000, seed=9)
    salt = _salt()  # a domain of its own: no earlier case pooled these keys (issue 25: salts key the pool)
    keys = block_hashes(prompt, BLOCK, domain_root(salt))
    reference = _tokens(d.complete(prompt, GEN, cache_salt=salt))
    _wait_pooled(client, keys)
    objects = _read_objects(port, keys, BLOCK_BYTES + 24)
    bad = objects[2].copy()
    bad[BLOCK_BYTES // 2] ^= 0x01
    _replace_objects(port, client, keys[2:3], [bad])
    before = _failures(d, "pool")
    d.reset_prefix_cache()  # as a restarted D: its own cache misses, the pool holds the prefix
    loaded = _tokens(d.complete(prompt, GEN, cache_salt=salt))
    assert loaded == reference, "a corrupt pool block reached the answer"
    assert _wait_failures(d, "pool", before + 1) == before + 1
    assert "KV pool block 2" in d.log_text()
