#!/usr/bin/env bash
# The fully async schedule on the simulation profile calibrated to verl's 128-GPU run (no GPU, no model load).
#   bash examples/sim_verl128/run.sh [key=value ...]   e.g. engine.sim.time_scale=10 trainer.sim.time_scale=10
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
exec "$root/.venv/bin/python" -m fully_async.runner --config-dir "$root/examples/sim_verl128" --config-name config "$@"
