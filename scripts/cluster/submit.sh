#!/usr/bin/env bash
# Submit a fully_async run to a Ray cluster as a Ray job, follow its logs, and exit with the job's status.
#
#   bash scripts/cluster/submit.sh [flags] [--] [runner args: --config-dir D --config-name N key=value ...]
#
#   --address URL        the job API (the head's dashboard) (env RAY_API_SERVER_ADDRESS; or from --temp-dir)
#   --temp-dir DIR       read the addresses from DIR/fully_async/cluster.env (written by start_head.sh on this machine;
#                        env FA_RAY_TEMP_DIR, default /tmp/ray)
#   --wait-nodes N       first wait (wait.sh) for N alive nodes ...
#   --wait-gpus G        ... and G GPUs in total
#   --wait-timeout S     ... for at most S seconds (default 600)
#   --module M           the entrypoint module (default fully_async.runner): `python -m M ARGS`
#   --python-c CODE      run `python -c CODE ARGS` instead (a quick check of the cluster and the environment)
#   --env NAME           also pass this environment variable to the job (repeatable)
#   --submission-id ID   the job's id (default fully_async-DATE-RANDOM)
#
# The job runs `cd REPO && FA_VENV/bin/python -m fully_async.runner ARGS` on the head node: no working_dir is
# uploaded, because the repository and its venv are at the same path on every node (a shared file system, or the
# same checkout on each node); that is the layout these scripts assume (docs/cluster.md).
# Environment passed to the job and every Ray worker it starts (runtime_env env_vars), when set here:
# NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, HF_TOKEN, HF_HOME, HF_HUB_CACHE,
# HF_HUB_OFFLINE, HF_ENDPOINT, PYTHONPATH, WANDB_API_KEY, WANDB_MODE, WANDB_ENTITY, WANDB_PROJECT, WANDB_BASE_URL,
# the --env names; and always RAY_worker_niceness=0. Only the names are printed, never the values; the values go to
# the job through a private file (mode 600, deleted on exit), not through the command line, where `ps` shows them.
# Ctrl-C (or SIGTERM) stops the job. Exit status: 0 when the job SUCCEEDED, the entrypoint's exit code when it
# FAILED with one (the runner exits 2 on a config error, 1 on a run error), 1 otherwise.
set -euo pipefail
# shellcheck source=scripts/cluster/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

api="${RAY_API_SERVER_ADDRESS:-}"
FA_RAY_TEMP_DIR="${FA_RAY_TEMP_DIR:-/tmp/ray}"
wait_nodes=""
wait_gpus=0
wait_timeout=600
module=fully_async.runner
python_c=""
env_names=(NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_DEBUG HF_TOKEN HF_HOME HF_HUB_CACHE HF_HUB_OFFLINE
    PYTHONPATH HF_ENDPOINT WANDB_API_KEY WANDB_MODE WANDB_ENTITY WANDB_PROJECT WANDB_BASE_URL)
submission_id="fully_async-$(date +%Y%m%d-%H%M%S)-$RANDOM"
while [[ $# -gt 0 ]]; do
    case "$1" in
    --address) need_value "$1" $# && api="$2" && shift 2 ;;
    --temp-dir) need_value "$1" $# && FA_RAY_TEMP_DIR="$2" && api="" && shift 2 ;;
    --wait-nodes) need_value "$1" $# && wait_nodes="$2" && shift 2 ;;
    --wait-gpus) need_value "$1" $# && wait_gpus="$2" && shift 2 ;;
    --wait-timeout) need_value "$1" $# && wait_timeout="$2" && shift 2 ;;
    --module) need_value "$1" $# && module="$2" && shift 2 ;;
    --python-c) need_value "$1" $# && python_c="$2" && shift 2 ;;
    --env) need_value "$1" $# && env_names+=("$2") && shift 2 ;;
    --submission-id) need_value "$1" $# && submission_id="$2" && shift 2 ;;
    --) shift && break ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' && exit 0 ;;
    *) break ;; # the runner's own arguments (Hydra flags and key=value overrides) start here
    esac
done

env_file="$(state_dir "$FA_RAY_TEMP_DIR")/cluster.env"
if [[ -z "$api" && -f "$env_file" ]]; then
    api="$(sed -n 's/^RAY_API_SERVER_ADDRESS=//p' "$env_file")"
fi
api="${api:-http://127.0.0.1:8265}"

if [[ -n "$wait_nodes" ]]; then
    wait_args=(--nodes "$wait_nodes" --gpus "$wait_gpus" --timeout "$wait_timeout")
    if [[ -f "$env_file" ]]; then wait_args+=(--temp-dir "$FA_RAY_TEMP_DIR"); fi
    bash "$FA_REPO/scripts/cluster/wait.sh" "${wait_args[@]}"
fi

# The runtime_env, built by python so that any value is quoted correctly; written to a private file.
runtime_env="$(mktemp "${TMPDIR:-/tmp}/fully_async-runtime-env-XXXXXX.json")"
chmod 600 "$runtime_env"
trap 'rm -f "$runtime_env"' EXIT
passed="$("$FA_PYTHON" - "$runtime_env" "${env_names[@]}" <<'PY'
import json, os, sys
path, names = sys.argv[1], sys.argv[2:]
env = {n: os.environ[n] for n in dict.fromkeys(names) if os.environ.get(n)}
env["RAY_worker_niceness"] = "0"  # the job's Ray workers at the driver's priority, as the runner does
with open(path, "w") as f:
    json.dump({"env_vars": env}, f)
print(" ".join(sorted(env)))
PY
)"

if [[ -n "$python_c" ]]; then
    entry=("$FA_PYTHON" -c "$python_c" "$@")
else
    entry=("$FA_PYTHON" -m "$module" "$@")
fi
# `ray job submit` runs the entrypoint through a shell in the head's working directory: run it from the repo.
cmd="cd $(printf '%q' "$FA_REPO") && exec$(printf ' %q' "${entry[@]}")"
say "job $submission_id at $api"
say "entrypoint: $cmd"
say "env passed to the job (names only): $passed"

# shellcheck disable=SC2317  # called by the trap
stop_job() {
    say "stopping job $submission_id"
    "$FA_RAY" job stop --address "$api" "$submission_id" >/dev/null 2>&1 || true
    exit 130
}
trap stop_job INT TERM
set +e
"$FA_RAY" job submit --address "$api" --submission-id "$submission_id" --runtime-env "$runtime_env" \
    -- bash -c "$cmd" &
wait $!
set -e
trap - INT TERM

# The job's final status decides the exit status (`ray job submit` only says whether it succeeded).
read -r status code message < <("$FA_PYTHON" - "$api" "$submission_id" <<'PY' || echo "UNKNOWN - no answer from the API"
import sys
from ray.job_submission import JobSubmissionClient
info = JobSubmissionClient(sys.argv[1]).get_job_info(sys.argv[2])
code = info.driver_exit_code
message = (info.message or "").split(", last available logs")[0]  # the logs were just printed
print(info.status.value, "-" if code is None else code, " ".join(message.split()))
PY
)
say "job $submission_id: $status, exit code $code${message:+ ($message)}"
case "$status" in
SUCCEEDED) exit 0 ;;
FAILED) [[ "$code" =~ ^[0-9]+$ && "$code" != 0 ]] && exit "$code" || exit 1 ;;
*) exit 1 ;;
esac
