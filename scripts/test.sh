#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up .venv if needed, lint and type-check, then the tests.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/unit      # quick loop: unit tests only (any pytest arguments work)
# ruff and mypy come with the [dev] extras that setup.sh installs; their settings are in pyproject.toml.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
echo "[test] ruff check ." >&2
.venv/bin/python -m ruff check --quiet .
echo "[test] mypy (pdserve/)" >&2
.venv/bin/python -m mypy --no-error-summary
exec .venv/bin/python -m pytest "${@:-tests}"
