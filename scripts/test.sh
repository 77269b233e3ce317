#!/usr/bin/env bash
# The project's test command (README, .ci/run): set up .venv if needed, then unit + integration tests.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/unit      # quick loop: unit tests only (any pytest arguments work)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest "${@:-tests}"
