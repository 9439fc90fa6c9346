#!/usr/bin/env bash
# An unmodified openai-SDK agent program trained through the OpenAI-compatible gateway (docs/agents.md).
#   bash examples/openai_agent/run.sh [key=value ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bash "$root/scripts/setup.sh"
# The agent as agent.py's callable `run` (in process, named by its absolute path: the rollouter runs on a Ray worker),
# unless the arguments name a command instead (rollout.multi_turn.gateway.command=...: one process per episode).
agent=("rollout.multi_turn.gateway.function=$root/examples/openai_agent/agent.py:run" "rollout.multi_turn.gateway.command=''")
for arg in "$@"; do
  [[ "$arg" == rollout.multi_turn.gateway.command=* ]] && agent=()
done
exec "$root/.venv/bin/python" -m fully_async.runner --config-dir "$root/examples/openai_agent" --config-name config \
  "${agent[@]}" "$@"
