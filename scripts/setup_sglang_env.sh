#!/usr/bin/env bash
# Creates (or reuses) the SGLang engine environment in .venv-sglang/ (engine.kind=sglang). Opt-in: scripts/setup.sh
# does not call it; `bash scripts/setup_engine_env.sh --sglang` or this script does, and CI does before the tests.
#
# With CUDA: `pip install sglang sglang-router` as SGLang documents.
# CPU-only (these machines): SGLang's wheel pins torch 2.14.1+cu130 and ~40 NVIDIA packages and still fails on CPU,
# so (recipe measured in docs/engines.md): CPU torch 2.13.0 first, sglang with --no-deps, then sglang's own
# requirements minus the CUDA-only ones, with torch pinned; torchvision removed (the PyPI wheel is a CUDA build).
# The server then also needs the import shims in fully_async/engines/sglang_cpu_shims/ on its PYTHONPATH, which the
# adapter (fully_async/engines/sglang.py) adds by itself on CPU.
# Idempotent: a second run takes seconds (a stamp records the spec once the import check passed).
#
#   bash scripts/setup_sglang_env.sh
#   SGLANG_VENV=/path/to/venv bash scripts/setup_sglang_env.sh     # then engine.python=/path/to/venv/bin/python
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
venv="${SGLANG_VENV:-$root/.venv-sglang}"
SGLANG_VERSION="0.5.23"
ROUTER_VERSION="0.3.2"
CPU_TORCH="2.13.0"

log() { printf '[setup-sglang] %s\n' "$*" >&2; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    device=cuda
else
    device=cpu
fi
spec="sglang==${SGLANG_VERSION} sglang-router==${ROUTER_VERSION} ${device}"
shims="$root/fully_async/engines/sglang_cpu_shims"

# What the server imports at start-up; on CPU the shims stand in for torchvision and sgl_kernel.
check() {
    if [ "$device" = cpu ]; then
        SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$shims" "$venv/bin/python" -c "import sglang.srt.entrypoints.http_server"
    else
        "$venv/bin/python" -c "import sglang.srt.entrypoints.http_server"
    fi
}

stamp="$venv/.fully_async-sglang"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$spec" ] \
    && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('sglang') and u.find_spec('sglang_router') else 1)"; then
    log "sglang venv up to date ($venv, $spec)"
    exit 0
fi

start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv with $($python --version 2>&1)"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip
if [ "$device" = cuda ]; then
    log "installing sglang==${SGLANG_VERSION} into $venv"
    "${pip[@]}" "sglang==${SGLANG_VERSION}" "sglang-router==${ROUTER_VERSION}"
else
    log "installing CPU torch ${CPU_TORCH} + sglang==${SGLANG_VERSION} (no CUDA packages) into $venv (~3 min)"
    "${pip[@]}" "torch==${CPU_TORCH}"
    "${pip[@]}" --no-deps "sglang==${SGLANG_VERSION}"
    reqs="$venv/.sglang-cpu-requirements.txt"
    # sglang's Requires-Dist (markers evaluated here), without the CUDA-only packages, with torch pinned to CPU.
    "$venv/bin/python" - "$CPU_TORCH" >"$reqs" <<'PY'
import importlib.metadata as md
import re
import sys

from pip._vendor.packaging.requirements import Requirement

cuda_only = re.compile(
    r"^(nvidia-.*|nvshmem.*|cuda-.*|flashinfer.*|flash-attn.*|sgl-deep-ep|sgl-deep-gemm|sgl-flash-mla|tilelang"
    r"|quack-kernels|humming-kernels|torch-memory-saver|sglang-kernel|sgl-kernel|torchaudio|torchcodec|torchvision"
    r"|torch)$"
)
for line in md.requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if cuda_only.match(re.sub(r"[-_.]+", "-", req.name).lower()):
        continue
    print(line.split(";")[0].strip())
print(f"torch=={sys.argv[1]}")
PY
    "${pip[@]}" -r "$reqs" "sglang-router==${ROUTER_VERSION}"
    # Something above may still pull the CUDA torchvision in ("operator torchvision::nms does not exist").
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if ! check >/dev/null 2>&1; then
    log "ERROR: 'import sglang.srt.entrypoints.http_server' fails in $venv:"
    check 2>&1 | tail -n 20 >&2
    exit 1
fi
echo "$spec" >"$stamp"
log "sglang venv ready ($venv, $spec) in $(($(date +%s) - start)) s"
