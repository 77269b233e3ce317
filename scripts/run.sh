#!/usr/bin/env bash
# The main job: set up .venv if needed, then measure the transfer engine between two processes
# against memcpy (and Mooncake TE / NIXL when installed). Extra arguments go to the benchmark.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python benchmarks/transfer_bench.py "${@:---quick}"
