"""A worker's refusal is the client's, and the router's own verdicts are vLLM's, against real workers (issue 42):

- every body of refusal_cases.CASES (bodies vLLM 0.32 refuses: invalid structured_outputs, bad logit_bias keys,
  max_tokens over the model's length, ...) gets through the 1P1D router the status and error type (a stream: the
  error event's code and type) one plain vLLM worker gives, streamed and not, and no worker address or repr;
- schemathesis (router_fuzz.py) on the router's /openapi.json with the checks not_a_server_error and
  status_code_conformance and no hooks finds nothing. The test command's tier: the examples and coverage phases,
  seed 42, one run within FUZZ_BUDGET_S (50 s: it reaches the operations it reaches in the document's order; the
  cases each got are printed). ``PDSERVE_FUZZ_FULL=1``: the fuzzing phase too, 100 examples, one run per operation,
  each within its share of PDSERVE_FUZZ_BUDGET_S (default 1200 s).

Shares pd_cluster (tests/conftest.py: SHARED_STACKS)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from .refusal_cases import OPEN, compare, leaks, table
from .router_fuzz import schemathesis
from .router_fuzz import table as fuzz_table

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("schemathesis") is None, reason="schemathesis is not installed"),
    pytest.mark.timeout(3600),
]

FULL = os.environ.get("PDSERVE_FUZZ_FULL") == "1"
FUZZ_BUDGET_S = int(os.environ.get("PDSERVE_FUZZ_BUDGET_S", "1200" if FULL else "50"))


def test_refusals_are_one_workers(pd_cluster, capsys):
    workers = pd_cluster.worker_urls()
    rows = compare(pd_cluster.router_url, pd_cluster.worker_urls("decode")[0], "rl")
    with capsys.disabled():
        print("\nrefusals, pdserve 1P1D vs one vLLM worker\n" + table(rows))
    differ = {name: f"{name}: pdserve {m} != vLLM {r}" for name, m, r in rows if (m.status, m.kind) != (r.status, r.kind)}
    assert [d for name, d in differ.items() if name not in OPEN] == [], "\n".join(differ.values())
    assert sorted(set(OPEN) - set(differ)) == [], "no longer different: drop them from refusal_cases.OPEN"
    leaked = [f"{name}: {m.message}" for name, m, _ in rows if leaks(m, workers)]
    assert leaked == [], "\n".join(leaked)


def test_schemathesis_finds_no_server_error(pd_cluster, tmp_path, capsys):
    phases = "examples,coverage,fuzzing" if FULL else "examples,coverage"
    run = schemathesis(pd_cluster.router_url, tmp_path, phases, 100 if FULL else 10, FUZZ_BUDGET_S, split=FULL)
    with capsys.disabled():
        print(f"\nschemathesis ({phases}, seed 42, budget {FUZZ_BUDGET_S} s) against 1P1D\n" + fuzz_table(run))
    assert run.cases > 0 and run.server_errors == 0, run.output[-12000:]
    assert run.rc == 0, run.output[-12000:]
