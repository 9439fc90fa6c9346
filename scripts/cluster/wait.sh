#!/usr/bin/env bash
# Wait until a Ray cluster has the expected nodes and GPUs, polling its resources (no fixed sleeps).
#
#   bash scripts/cluster/wait.sh [--address IP:PORT | --temp-dir DIR] [--nodes N] [--gpus G] [--timeout S]
#
#   --address IP:PORT   the head's GCS address (env RAY_ADDRESS)
#   --temp-dir DIR      read the address from DIR/fully_async/cluster.env (written by start_head.sh on this machine;
#                       env FA_RAY_TEMP_DIR, default /tmp/ray)
#   --nodes N           alive nodes to wait for (default 1)
#   --gpus G            GPUs declared by the alive nodes, in total (default 0)
#   --timeout S         give up after S seconds (default 300) with what was missing; exit 1
#   --interval S        seconds between polls (default 1)
#
# Exit 0 once the cluster has them, printing one line per node (address, CPUs, GPUs).
set -euo pipefail
# shellcheck source=scripts/cluster/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

address="${RAY_ADDRESS:-}"
FA_RAY_TEMP_DIR="${FA_RAY_TEMP_DIR:-/tmp/ray}"
nodes=1
gpus=0
timeout_s=300
interval=1
while [[ $# -gt 0 ]]; do
    case "$1" in
    --address) need_value "$1" $# && address="$2" && shift 2 ;;
    --temp-dir) need_value "$1" $# && FA_RAY_TEMP_DIR="$2" && address="" && shift 2 ;;
    --nodes) need_value "$1" $# && nodes="$2" && shift 2 ;;
    --gpus) need_value "$1" $# && gpus="$2" && shift 2 ;;
    --timeout) need_value "$1" $# && timeout_s="$2" && shift 2 ;;
    --interval) need_value "$1" $# && interval="$2" && shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' && exit 0 ;;
    *) die "unknown flag $1 (see --help)" ;;
    esac
done
env_file="$(state_dir "$FA_RAY_TEMP_DIR")/cluster.env"
if [[ -z "$address" && -f "$env_file" ]]; then
    address="$(sed -n 's/^RAY_ADDRESS=//p' "$env_file")"
fi
[[ -n "$address" ]] || die "no cluster address: pass --address IP:PORT or --temp-dir of a head started here"

say "waiting up to ${timeout_s}s for $nodes nodes and $gpus GPUs at $address"
# `timeout` is the backstop should a connection attempt hang past the poller's own deadline.
exec timeout --kill-after=10 "$((${timeout_s%.*} + 60))" "$FA_PYTHON" "$FA_REPO/scripts/cluster/wait_cluster.py" \
    --address "$address" --nodes "$nodes" --gpus "$gpus" --timeout "$timeout_s" --interval "$interval"
