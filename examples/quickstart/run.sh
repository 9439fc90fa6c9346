#!/usr/bin/env bash
# Quickstart: a short fully asynchronous run on this machine (CPU, tiny model, built-in task).
#   bash examples/quickstart/run.sh [key=value ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/python" -m fully_async.runner --config-dir "$root/examples/quickstart" --config-name config "$@"
