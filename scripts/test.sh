#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up .venv if needed, lint and type-check, then the tests.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/unit      # quick loop: unit tests only (any pytest arguments work)
# ruff, mypy and pytest-xdist come with the [dev] extras that setup.sh installs; their settings are in pyproject.toml.
# pytest runs the tests on 2 processes (pytest-xdist). Each file, or each set of files that share one vLLM stack
# (tests/conftest.py: SHARED_STACKS, whose scheduler replaces --dist loadfile's), runs whole on one process, so a
# stack starts once. A serial run keeps only ~1.2 of 2 cores busy, most of it in vLLM's single-threaded start-up.
# PDSERVE_TEST_WORKERS=0 runs them serially (one process).
# The conformance suite runs its full tier here (every value of every field of vLLM's request models, streamed and
# not, on the shared 1P1D stack; issue 41); PDSERVE_CONFORMANCE_FULL=0 runs the quick tier (each field's first value).
set -euo pipefail
export PDSERVE_CONFORMANCE_FULL="${PDSERVE_CONFORMANCE_FULL:-1}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
echo "[test] ruff check ." >&2
.venv/bin/python -m ruff check --quiet .
echo "[test] mypy (pdserve/), beside the tests (its output: .mypy.log)" >&2
.venv/bin/python -m mypy --no-error-summary > .mypy.log 2>&1 &
MYPY=$!
set +e
.venv/bin/python -m pytest -n "${PDSERVE_TEST_WORKERS:-2}" --dist loadfile --durations=30 "${@:-tests}"
RC=$?
set -e
if ! wait "$MYPY"; then
    echo "[test] mypy failed:" >&2
    cat .mypy.log >&2
    exit 1
fi
echo "[test] mypy: no issues" >&2
exit "$RC"
