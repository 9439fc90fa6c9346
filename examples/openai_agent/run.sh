#!/usr/bin/env bash
# An unmodified openai-SDK agent program trained through the OpenAI-compatible gateway (docs/agents.md).
#   bash examples/openai_agent/run.sh [key=value ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bash "$root/scripts/setup.sh"
# The agent as a command (one process per episode), unless the arguments name it as a callable instead
# (rollout.multi_turn.gateway.function=$PWD/examples/openai_agent/agent.py:run: the same program, no process per episode).
agent=("rollout.multi_turn.gateway.command=$root/.venv/bin/python $root/examples/openai_agent/agent.py")
for arg in "$@"; do
  [[ "$arg" == rollout.multi_turn.gateway.function=* ]] && agent=("rollout.multi_turn.gateway.command=''")
done
exec "$root/.venv/bin/python" -m fully_async.runner --config-dir "$root/examples/openai_agent" --config-name config \
  "${agent[@]}" "$@"
