"""Differential conformance (issue 25, item 5): every field of vLLM's request models, with generated valid and
edge values, sent greedy to one plain vLLM worker (pd_cluster's D, on its own endpoints) and to the 1P1D router
in the same run; text, token ids, logprobs, finish reason, usage, and an error's status and parameter compared,
streamed and not (tests/conformance/compare.py). Known differences are few, documented in compare.KNOWN, and
each is checked by its own rule.

Full tier (``PDSERVE_CONFORMANCE_FULL=1``: the test command, scripts/test.sh, sets it): every value, streamed and not.
Quick tier (pytest run directly, or the test command with ``PDSERVE_CONFORMANCE_FULL=0``): the first generated value
(its lower edge) of each field the router reads, rewrites or refuses (cases.QUICK_USES), unstreamed, streamed too
for the fields in suite.STREAMED.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from .cases import NO_CASES, cases, edge_cases, quick, vllm_models
from .suite import OPEN, field_table, report, run, table

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(1800),
]  # shares pd_cluster (tests/conftest.py: SHARED_STACKS)

FULL = os.environ.get("PDSERVE_CONFORMANCE_FULL") == "1"


def test_every_vllm_field_has_cases():
    """A field vLLM adds gets generated cases from its type, or a line in cases.NO_CASES saying why not."""
    for endpoint, model in vllm_models().items():
        covered = {c.field for c in cases(endpoint, model)}
        missing = sorted(set(model.model_fields) - covered - set(NO_CASES))
        assert missing == [], f"{endpoint}: no conformance case for {missing}"


def _all_cases() -> list:
    every = [c for endpoint, model in vllm_models().items() for c in cases(endpoint, model)]
    return (every if FULL else quick(every)) + edge_cases()


def test_router_answers_as_one_worker(pd_cluster, capsys):
    router, worker = pd_cluster.router_url, pd_cluster.worker_urls("decode")[0]
    verdicts, seconds = run(router, worker, _all_cases(), stream_all=FULL)
    with capsys.disabled():
        print(f"\nconformance ({'full' if FULL else 'quick'} tier): {len(verdicts)} cases in {seconds:.1f} s\n"
              + table(verdicts) + "\n\n" + field_table(verdicts))
    if os.environ.get("PDSERVE_CONFORMANCE_REPORT"):
        with open(os.environ["PDSERVE_CONFORMANCE_REPORT"], "w") as f:
            json.dump(report(verdicts), f, indent=1)
    different = [f"{v.key}: {v.detail}" for v in verdicts if v.kind == "different"]
    assert different == [], "\n".join(different)
    fixed = [v.key for v in verdicts if v.key in OPEN and v.kind != "open"]
    assert fixed == [], f"no longer different: drop them from suite.OPEN: {fixed}"
    # every known difference the suite allows is seen at least once, so none hides a case it was not written for
    seen = {v.kind for v in verdicts}
    assert {"identical", "refused"} <= seen, seen
