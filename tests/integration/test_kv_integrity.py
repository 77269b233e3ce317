"""Issue 27, end to end: injected KV corruption never reaches an answer.

Two vLLM CPU workers P and D (fp32 random Llama, PdserveConnector with ``kv_checksum`` on by default and test faults
allowed): prefill0 and decode0 of the shared 1P2D launch (conftest.py: ``pd_pair``). Each case injects one
fault, checks that it was detected (the read's stats, the log, ``vllm:pdserve_kv_checksum_failures_total`` by path,
or the refusal naming the field) and that greedy output still equals one worker's own:

* a byte flipped in transit (``flip``: D flips a byte of a received block before its check; ``flip~SEED``: bytes at
  random offsets of several units, any layer);
* a late write into P's leased block after P sealed it, before D reads (``late``, given to P);
* D given a P of another model or dtype (P's fingerprint in kv_transfer_params altered: the same check a real P of
  another model meets, without starting a third vLLM server);

A byte flipped in a KV pool object is test_store_vllm.py's case (its worker has a pool; these have none).
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from .corruption_tally import injected
from .test_pd_exactness import Worker, _prompt, _salt, _tokens, _wait_usage_zero

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]  # pd_pair: P and D of the shared pd_faults launch (tests/conftest.py: SHARED_STACKS)
GEN = 12
BLOCK = 128
PROMPT = 700  # 6 blocks, the last partial: 1.5 MiB (2 layers x 2 KV heads x 64 x fp32 x K, V: 256 KiB a block)
STREAMED = 1100  # 9 blocks, 2.25 MiB: D hashes what lands during the read (ReadVerifier.min_bytes, 2 MiB)


@pytest.fixture(scope="module")
def stack(pd_pair):
    return pd_pair  # conftest.py: prefill0 and decode0 of the shared 1P2D launch


def _failures(server: Worker, path: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    pat = rf'^vllm:pdserve_kv_checksum_failures_total{{[^}}]*path="{path}"[^}}]*}} ([0-9.e+-]+)$'
    return sum(float(v) for v in re.findall(pat, text, re.M))


def _wait_failures(server: Worker, path: str, at_least: float, timeout: float = 20.0) -> float:
    end = time.monotonic() + timeout
    value = _failures(server, path)
    while value < at_least and time.monotonic() < end:
        time.sleep(0.5)  # vLLM publishes connector stats with its periodic logging
        value = _failures(server, path)
    return value


def _case(stack, seed: int, p_fault: str = "", d_fault: str = "", fingerprint: dict | None = None,
          length: int = PROMPT):
    """Colocated reference on D, then P -> D with the fault; (reference, P -> D tokens, D's read stats)."""
    p, d = stack
    prompt = _prompt(length, seed)
    reference = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    pparams = {"do_remote_decode": True, **({"pdserve_test_fault": p_fault} if p_fault else {})}
    salt = _salt()  # P and D in one key domain: D refuses P's KV of another
    pr = p.complete(prompt, 1, kv_transfer_params=pparams, cache_salt=salt)
    params = dict(pr["kv_transfer_params"])
    assert params["remote_fingerprint"]["dtype"] == "float32", params
    if d_fault:
        params["pdserve_test_fault"] = d_fault
    if fingerprint:
        params["remote_fingerprint"] = {**params["remote_fingerprint"], **fingerprint}
    if p_fault == "late":
        time.sleep(0.5)  # P's worker sealed the lease and then wrote into its block
    dr = d.complete(prompt + _tokens(pr), GEN - 1, kv_transfer_params=params, cache_salt=salt)
    return reference, _tokens(pr) + _tokens(dr), dr["kv_transfer_params"]["pdserve"]


def test_clean_handoff_is_verified(stack):
    reference, tokens, stats = _case(stack, seed=1)
    assert stats["ok"] and stats["verified"] == -(-PROMPT // BLOCK) and not stats["streamed"], stats
    assert tokens == reference
    reference, tokens, stats = _case(stack, seed=11, length=STREAMED)
    assert stats["ok"] and stats["verified"] == -(-STREAMED // BLOCK) and stats["streamed"], stats
    assert tokens == reference


@pytest.mark.parametrize("length", [PROMPT, STREAMED])
def test_byte_flipped_in_transit_is_recomputed(stack, length):
    """700 tokens (1.5 MiB: D hashes after the read) and 1100 (2.25 MiB: D hashes each frame as it lands)."""
    p, d = stack
    before = _failures(d, "p2p")
    case = injected("p2p", f"flip in transit ({length} tokens)")
    reference, tokens, stats = _case(stack, seed=2, d_fault="flip", length=length)
    case.done(not stats["ok"] and "differ from P's checksums" in stats["error"], tokens == reference)
    assert not stats["ok"] and "differ from P's checksums" in stats["error"], stats
    assert stats["streamed"] == (length == STREAMED), stats
    assert tokens == reference, "a corrupt block reached the answer"
    assert _wait_failures(d, "p2p", before + 1) == before + 1
    assert "KV checksum failure" in d.log_text()
    assert _wait_usage_zero(p, 10.0) <= 1e-9  # P still freed its blocks


@pytest.mark.parametrize("length, seed", [(PROMPT, 41), (STREAMED, 42)])
def test_bytes_flipped_at_random_places_are_recomputed(stack, length, seed):
    """Issue 41: ``flip~SEED`` XORs one to four bytes at random offsets of random units (any block, layer, K or V
    run) as the read lands (1100 tokens) or after it (700), before D hashes them; each is caught."""
    case = injected("p2p", f"flip~{seed} at random places ({length} tokens)")
    reference, tokens, stats = _case(stack, seed=seed, d_fault=f"flip~{seed}", length=length)
    case.done(not stats["ok"] and "differ from P's checksums" in stats.get("error", ""), tokens == reference)
    assert not stats["ok"] and "differ from P's checksums" in stats["error"], stats
    assert tokens == reference, "a corrupt block reached the answer"


def test_late_write_into_p_block_is_recomputed(stack):
    p, d = stack
    before = _failures(d, "p2p")
    case = injected("late_write", "write into P's block after its seal")
    reference, tokens, stats = _case(stack, seed=3, p_fault="late")
    case.done(not stats["ok"] and "differ from P's checksums" in stats.get("error", ""), tokens == reference)
    assert not stats["ok"] and "differ from P's checksums" in stats["error"], stats
    assert "pdserve_test_fault=late" in p.log_text()
    assert tokens == reference
    assert _wait_failures(d, "p2p", before + 1) == before + 1


@pytest.mark.parametrize("field, value", [("model_hash", "0123456789abcdef"), ("dtype", "bfloat16")])
def test_p_of_another_model_or_dtype_is_refused_by_field(stack, field, value):
    p, _ = stack
    case = injected("foreign_p", f"P of another {field}")
    reference, tokens, stats = _case(stack, seed=4 + len(field), fingerprint={field: value})
    case.done(not stats["ok"] and str(stats.get("refused", "")).startswith(f"fingerprint mismatch: {field}"),
              tokens == reference)
    assert not stats["ok"] and stats["refused"].startswith(f"fingerprint mismatch: {field}: P='{value}'"), stats
    assert tokens == reference
    assert _wait_usage_zero(p, 10.0) <= 1e-9  # D told P to free the blocks it refused
