#!/usr/bin/env bash
# Start the Ray head node of a fully_async cluster on this machine, with the dashboard on (it serves `ray job submit`).
#
#   bash scripts/cluster/start_head.sh [flags] [-- extra `ray start` args]
#
#   --port P               GCS port (env RAY_PORT, default 6379)
#   --node-ip-address IP   this node's address as the other nodes reach it (env FA_NODE_IP; default: Ray's choice)
#   --ifname IFACE         take the node IP from this interface; also the default of NCCL_SOCKET_IFNAME and
#                          GLOO_SOCKET_IFNAME (env FA_IFNAME)
#   --num-cpus N           logical CPUs this node declares (env FA_NUM_CPUS; default: Ray counts them)
#   --num-gpus N           GPUs this node declares (env FA_NUM_GPUS; default: Ray counts them). 0 keeps the trainer
#                          and engines off the head
#   --temp-dir DIR         Ray's temp dir on this node (env FA_RAY_TEMP_DIR, default /tmp/ray); stop.sh takes the same
#   --dashboard-host H     where the dashboard (job API) listens (env FA_DASHBOARD_HOST, default 127.0.0.1: submit
#                          from this node; 0.0.0.0 to submit from elsewhere, then keep Ray's token auth on)
#   --dashboard-port P     (env FA_DASHBOARD_PORT, default 8265)
#   --foreground           exec `ray start --block` in the foreground (for srun); default: start it in the background,
#                          wait until the node is up and return
#   --timeout S            how long to wait for the node to start (default 120)
#
# Prints what it runs, then RAY_ADDRESS=IP:PORT (for workers and drivers) and RAY_API_SERVER_ADDRESS=http://HOST:PORT
# (for `ray job submit`), also written to TEMP_DIR/fully_async/cluster.env. Ray workers run at niceness 0
# (RAY_worker_niceness=0 unless set). NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME set here reach every Ray worker of
# this node. Auth: Ray's token auth stays as configured (RAY_AUTH_MODE, RAY_AUTH_TOKEN, ~/.ray/auth_token); only
# local tests disable it. See docs/cluster.md.
set -euo pipefail
# shellcheck source=scripts/cluster/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

port="${RAY_PORT:-6379}"
node_ip="${FA_NODE_IP:-}"
num_cpus="${FA_NUM_CPUS:-}"
num_gpus="${FA_NUM_GPUS:-}"
FA_RAY_TEMP_DIR="${FA_RAY_TEMP_DIR:-/tmp/ray}"
dashboard_host="${FA_DASHBOARD_HOST:-127.0.0.1}"
dashboard_port="${FA_DASHBOARD_PORT:-8265}"
foreground=0
timeout_s=120
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --port) need_value "$1" $# && port="$2" && shift 2 ;;
    --node-ip-address) need_value "$1" $# && node_ip="$2" && shift 2 ;;
    --ifname) need_value "$1" $# && FA_IFNAME="$2" && shift 2 ;;
    --num-cpus) need_value "$1" $# && num_cpus="$2" && shift 2 ;;
    --num-gpus) need_value "$1" $# && num_gpus="$2" && shift 2 ;;
    --temp-dir) need_value "$1" $# && FA_RAY_TEMP_DIR="$2" && shift 2 ;;
    --dashboard-host) need_value "$1" $# && dashboard_host="$2" && shift 2 ;;
    --dashboard-port) need_value "$1" $# && dashboard_port="$2" && shift 2 ;;
    --foreground) foreground=1 && shift ;;
    --timeout) need_value "$1" $# && timeout_s="$2" && shift 2 ;;
    --) shift && extra=("$@") && break ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' && exit 0 ;;
    *) die "unknown flag $1 (see --help)" ;;
    esac
done

[[ -z "${FA_IFNAME:-}" || -n "$node_ip" ]] || node_ip="$(ifname_ip "$FA_IFNAME")"
export_ifname
FA_RAY_TEMP_DIR="$(mkdir -p "$FA_RAY_TEMP_DIR" && cd "$FA_RAY_TEMP_DIR" && pwd)"

args=(--head --port="$port" --temp-dir="$FA_RAY_TEMP_DIR" --include-dashboard=true
    --dashboard-host="$dashboard_host" --dashboard-port="$dashboard_port" --disable-usage-stats)
[[ -n "$node_ip" ]] && args+=(--node-ip-address="$node_ip")
[[ -n "$num_cpus" ]] && args+=(--num-cpus="$num_cpus")
[[ -n "$num_gpus" ]] && args+=(--num-gpus="$num_gpus")
args+=("${extra[@]}")

# Written before the start so that wait.sh / submit.sh --temp-dir find the cluster while it comes up (srun case).
# Ray rewrites 127.0.0.1 as a node IP to the host's address; another loopback address (127.0.0.2) stays loopback.
address_ip="${node_ip:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
[[ "$dashboard_host" == 0.0.0.0 || "$dashboard_host" == "::" ]] && api_host="${address_ip:-127.0.0.1}" ||
    api_host="$dashboard_host"
state="$(state_dir "$FA_RAY_TEMP_DIR")"
mkdir -p "$state"
{
    echo "RAY_ADDRESS=${address_ip:-127.0.0.1}:$port"
    echo "RAY_API_SERVER_ADDRESS=http://$api_host:$dashboard_port"
} >"$state/cluster.env"
cat "$state/cluster.env"
say "cluster settings written to $state/cluster.env"
run_ray_node head "$foreground" "$timeout_s" "${args[@]}"
# The GCS address Ray actually advertises (its own choice of node IP when none was given).
if [[ -s "$FA_RAY_TEMP_DIR/ray_current_cluster" ]]; then
    gcs="$(cat "$FA_RAY_TEMP_DIR/ray_current_cluster")"
    sed -i "s|^RAY_ADDRESS=.*|RAY_ADDRESS=$gcs|" "$state/cluster.env"
fi
cat "$state/cluster.env"
gcs="${gcs:-${address_ip:-127.0.0.1}:$port}"
say "head started; workers join with: bash scripts/cluster/start_worker.sh --address $gcs"
