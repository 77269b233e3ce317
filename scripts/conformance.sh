#!/usr/bin/env bash
# The full conformance tier (issue 41): every generated value of every field of vLLM's request models, streamed and
# not, against one plain vLLM worker and the 1P1D router on one shared stack (tests/conformance/). Its own command,
# beside the test command (whose quick tier sends each field's first value), so the test command keeps
# its time. PDSERVE_CONFORMANCE_REPORT=FILE also writes every verdict as JSON.
#   bash scripts/conformance.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
PDSERVE_CONFORMANCE_FULL=1 exec .venv/bin/python -m pytest -q -n0 -p no:cacheprovider tests/conformance "$@"
