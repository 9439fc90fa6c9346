#!/usr/bin/env bash
# Start a Ray worker node on this machine and join it to a fully_async cluster's head.
#
#   bash scripts/cluster/start_worker.sh --address HEAD_IP:PORT [flags] [-- extra `ray start` args]
#
#   --address IP:PORT      the head's GCS address, as start_head.sh printed it (env RAY_ADDRESS; or --temp-dir of a
#                          head started on this machine, whose cluster.env holds it)
#   --node-ip-address IP   this node's address as the other nodes reach it (env FA_NODE_IP; default: Ray's choice,
#                          the address that routes to the head)
#   --ifname IFACE         take the node IP from this interface; also the default of NCCL_SOCKET_IFNAME and
#                          GLOO_SOCKET_IFNAME (env FA_IFNAME)
#   --num-cpus N           logical CPUs this node declares (env FA_NUM_CPUS; default: Ray counts them)
#   --num-gpus N           GPUs this node declares (env FA_NUM_GPUS; default: Ray counts them)
#   --temp-dir DIR         Ray's temp dir on this node (env FA_RAY_TEMP_DIR, default /tmp/ray); stop.sh takes the same
#   --foreground           exec `ray start --block` in the foreground (for srun); default: start it in the background,
#                          wait until the node has joined and return
#   --timeout S            how long to wait for the node to start (default 120)
#
# Ray workers run at niceness 0 (RAY_worker_niceness=0 unless set); NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME set here
# reach every Ray worker of this node. The worker needs the head's auth token when the head uses one
# (RAY_AUTH_TOKEN or ~/.ray/auth_token; a shared home directory carries it). See docs/cluster.md.
set -euo pipefail
# shellcheck source=scripts/cluster/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

address="${RAY_ADDRESS:-}"
node_ip="${FA_NODE_IP:-}"
num_cpus="${FA_NUM_CPUS:-}"
num_gpus="${FA_NUM_GPUS:-}"
FA_RAY_TEMP_DIR="${FA_RAY_TEMP_DIR:-/tmp/ray}"
foreground=0
timeout_s=120
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --address) need_value "$1" $# && address="$2" && shift 2 ;;
    --node-ip-address) need_value "$1" $# && node_ip="$2" && shift 2 ;;
    --ifname) need_value "$1" $# && FA_IFNAME="$2" && shift 2 ;;
    --num-cpus) need_value "$1" $# && num_cpus="$2" && shift 2 ;;
    --num-gpus) need_value "$1" $# && num_gpus="$2" && shift 2 ;;
    --temp-dir) need_value "$1" $# && FA_RAY_TEMP_DIR="$2" && shift 2 ;;
    --foreground) foreground=1 && shift ;;
    --timeout) need_value "$1" $# && timeout_s="$2" && shift 2 ;;
    --) shift && extra=("$@") && break ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' && exit 0 ;;
    *) die "unknown flag $1 (see --help)" ;;
    esac
done

FA_RAY_TEMP_DIR="$(mkdir -p "$FA_RAY_TEMP_DIR" && cd "$FA_RAY_TEMP_DIR" && pwd)"
env_file="$(state_dir "$FA_RAY_TEMP_DIR")/cluster.env"
if [[ -z "$address" && -f "$env_file" ]]; then
    address="$(sed -n 's/^RAY_ADDRESS=//p' "$env_file")"
fi
[[ -n "$address" ]] || die "no head address: pass --address HEAD_IP:PORT (printed by start_head.sh) or set RAY_ADDRESS"
[[ -z "${FA_IFNAME:-}" || -n "$node_ip" ]] || node_ip="$(ifname_ip "$FA_IFNAME")"
export_ifname

args=(--address="$address" --temp-dir="$FA_RAY_TEMP_DIR" --disable-usage-stats)
[[ -n "$node_ip" ]] && args+=(--node-ip-address="$node_ip")
[[ -n "$num_cpus" ]] && args+=(--num-cpus="$num_cpus")
[[ -n "$num_gpus" ]] && args+=(--num-gpus="$num_gpus")
args+=("${extra[@]}")

run_ray_node worker "$foreground" "$timeout_s" "${args[@]}"
say "worker joined the cluster at $address"
