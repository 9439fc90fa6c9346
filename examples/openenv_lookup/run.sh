#!/usr/bin/env bash
# The OpenEnv lookup example: task=lookup's tool behind a pool of OpenEnv server processes (docs/environments.md).
#   bash examples/openenv_lookup/run.sh [key=value ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FULLY_ASYNC_EXTRAS="${FULLY_ASYNC_EXTRAS:-envs}" bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/python" -m fully_async.runner --config-dir "$root/examples/openenv_lookup" --config-name config "$@"
