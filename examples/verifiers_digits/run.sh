#!/usr/bin/env bash
# The verifiers example: the installed environment fa-vf-digits by name (docs/environments.md).
#   bash examples/verifiers_digits/run.sh [key=value ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FULLY_ASYNC_EXTRAS="${FULLY_ASYNC_EXTRAS:-envs}" bash "$root/scripts/setup.sh"
rows="$(mktemp --suffix=.jsonl)"
trap 'rm -f "$rows"' EXIT
"$root/.venv/bin/python" -m fully_async.envs.verifiers_env fa-vf-digits --out "$rows"
"$root/.venv/bin/python" -m fully_async.runner --config-dir "$root/examples/verifiers_digits" --config-name config \
    "data.train_files=[$rows]" "$@"
