#!/usr/bin/env bash
# Search agent: multi-turn tool use against a local BM25 retrieval server (README.md next to this file).
#
#   bash examples/search_agent/run.sh data                                # corpus + questions -> ~/data/search_agent
#   bash examples/search_agent/run.sh smoke  [key=value ...]              # this machine: retrieval server + tiny model
#   GPU cluster, 2 nodes x 4 GPUs, through scripts/cluster/:
#   node A:  bash examples/search_agent/run.sh head                      # Ray head, 4 GPUs
#   node B:  bash examples/search_agent/run.sh worker HEAD_IP:6379       # Ray worker, 4 GPUs
#   node A:  bash examples/search_agent/run.sh submit [key=value ...]     # retrieval server here, then the job
#   node A, B: bash examples/search_agent/run.sh stop
#
# The retrieval server runs on node A (the driver's node, where the Rollouter and so every search call runs), on
# FA_RETRIEVAL_PORT (default 8000); FA_RETRIEVAL_URL tells the tool where it is. The variables of scripts/cluster/
# apply (FA_IFNAME, HF_TOKEN, ...); the repository, the model cache and ~/data/search_agent must be at the same
# paths on both nodes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$root/examples/search_agent"
port="${FA_RETRIEVAL_PORT:-8000}"
export FA_RETRIEVAL_URL="${FA_RETRIEVAL_URL:-http://127.0.0.1:$port}"
retrieval() {
    pid="$(bash "$here/launch_retrieval.sh" --port "$port")"
    trap 'kill "$pid" 2>/dev/null || true' EXIT
}
cmd="${1:-}"
shift || true
case "$cmd" in
data) cd "$root" && exec "$root/.venv/bin/python" -m examples.search_agent.corpus "$@" ;;
smoke)
    retrieval
    cd "$root"
    "$root/.venv/bin/python" -m fully_async.runner --config-dir "$here/cpu" --config-name config "$@"
    ;;
head) exec bash "$root/scripts/cluster/start_head.sh" --num-gpus "${FA_NUM_GPUS:-4}" "$@" ;;
worker)
    [[ $# -ge 1 ]] || { echo "usage: run.sh worker HEAD_IP:PORT" >&2 && exit 2; }
    address="$1"
    shift
    exec bash "$root/scripts/cluster/start_worker.sh" --address "$address" --num-gpus "${FA_NUM_GPUS:-4}" "$@"
    ;;
submit)
    retrieval
    bash "$root/scripts/cluster/submit.sh" --wait-nodes 2 --wait-gpus 8 --wait-timeout "${FA_WAIT_TIMEOUT:-900}" --env FA_RETRIEVAL_URL \
        --config-dir "$here" --config-name config "$@"
    ;;
stop) exec bash "$root/scripts/cluster/stop.sh" "$@" ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
