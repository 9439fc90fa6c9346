#!/usr/bin/env bash
# The OpenEnv example: the built-in digits environment in a pool of OpenEnv server processes (docs/environments.md).
#   bash examples/openenv_digits/run.sh [key=value ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FULLY_ASYNC_EXTRAS="${FULLY_ASYNC_EXTRAS:-envs}" bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/python" -m fully_async.runner --config-dir "$root/examples/openenv_digits" --config-name config "$@"
