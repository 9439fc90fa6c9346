#!/usr/bin/env bash
# GSM8K with Qwen2.5-7B-Instruct on 2 nodes x 8 GPUs, through scripts/cluster/ (README.md: resources, data, overrides).
#
#   node A:  bash examples/math_qwen2.5_7b_2x8/run.sh head                 # Ray head, 8 GPUs
#   node B:  bash examples/math_qwen2.5_7b_2x8/run.sh worker HEAD_IP:6379  # Ray worker, 8 GPUs
#   node A:  bash examples/math_qwen2.5_7b_2x8/run.sh plan   [key=value ...]  # where everything goes; exits
#   node A:  bash examples/math_qwen2.5_7b_2x8/run.sh submit [key=value ...]  # waits for 2 nodes / 16 GPUs, runs
#   node A, B: bash examples/math_qwen2.5_7b_2x8/run.sh stop
#   Slurm:   bash examples/math_qwen2.5_7b_2x8/run.sh slurm [key=value ...]   # sbatch: all of the above
#
# FA_IFNAME (the interface between the nodes, e.g. ib0), HF_TOKEN, WANDB_API_KEY, FA_RAY_TEMP_DIR and the other
# variables of scripts/cluster/ apply. The repository (with .venv and .venv-engine) must be at the same path on both
# nodes, and so must the model cache (HF_HOME) and the data (~/data/gsm8k): a shared file system, or copies.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
example=(--config-dir "$root/examples/math_qwen2.5_7b_2x8" --config-name config)
cmd="${1:-}"
shift || true
case "$cmd" in
head) exec bash "$root/scripts/cluster/start_head.sh" --num-gpus "${FA_NUM_GPUS:-8}" "$@" ;;
worker)
    [[ $# -ge 1 ]] || { echo "usage: run.sh worker HEAD_IP:PORT" >&2 && exit 2; }
    address="$1"
    shift
    exec bash "$root/scripts/cluster/start_worker.sh" --address "$address" --num-gpus "${FA_NUM_GPUS:-8}" "$@"
    ;;
plan)
    # The placement plan against the running cluster (RAY_ADDRESS from the head's cluster.env); nothing starts.
    env_file="${FA_RAY_TEMP_DIR:-/tmp/ray}/fully_async/cluster.env"
    if [[ ! -f "$env_file" ]]; then
        echo "run.sh plan: no cluster started here ($env_file); run 'run.sh head' first" >&2
        exit 1
    fi
    RAY_ADDRESS="$(sed -n 's/^RAY_ADDRESS=//p' "$env_file")"
    export RAY_ADDRESS
    exec "$root/.venv/bin/python" -m fully_async.runner --plan "${example[@]}" "$@"
    ;;
submit)
    exec bash "$root/scripts/cluster/submit.sh" --wait-nodes 2 --wait-gpus 16 --wait-timeout "${FA_WAIT_TIMEOUT:-900}" \
        "${example[@]}" "$@"
    ;;
stop) exec bash "$root/scripts/cluster/stop.sh" "$@" ;;
slurm) cd "$root" && exec sbatch --nodes=2 --gpus-per-node=8 scripts/cluster/slurm.sbatch "${example[@]}" "$@" ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
