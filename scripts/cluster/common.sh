# Shared by the scripts in scripts/cluster/ (sourced, not run). Defines where the repo, its venv and a node's state
# live, and small helpers. Every setting has a flag in the calling script and an environment variable here:
#   FA_VENV            the project venv holding `ray` and `python` (default: REPO/.venv); the same path on every node
#   FA_RAY_TEMP_DIR    Ray's --temp-dir on this node (default /tmp/ray); this node's state is kept under it
#   FA_NODE_IP         --node-ip-address of this node (default: Ray's choice, the address that routes to the head)
#   FA_IFNAME          network interface of this node: its IPv4 address becomes the node IP and, unless set,
#                      NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
#   RAY_PORT           the head's GCS port (default 6379)
# shellcheck shell=bash

FA_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FA_VENV="${FA_VENV:-$FA_REPO/.venv}"
FA_RAY="$FA_VENV/bin/ray"
# shellcheck disable=SC2034  # used by the scripts that source this file
FA_PYTHON="$FA_VENV/bin/python"

say() { echo "cluster: $*"; }
die() {
    echo "cluster: ERROR: $*" >&2
    exit 1
}

# The state of the nodes started from this machine under one Ray temp dir: pid files, logs, cluster.env.
state_dir() { echo "$1/fully_async"; }

# need_value FLAG ARGC: a flag that takes a value must have one.
need_value() { [[ $2 -ge 2 ]] || die "$1 needs a value (see the usage at the top of the script)"; }

# The IPv4 address of a network interface (for --ifname).
ifname_ip() {
    local ip
    ip="$(ip -4 -o addr show dev "$1" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')"
    [[ -n "$ip" ]] || die "interface $1 has no IPv4 address (ip -4 addr show dev $1)"
    echo "$ip"
}

# Export the interface settings that NCCL and gloo read, from --ifname when they are not set already. Ray workers
# inherit the environment of `ray start`, so the trainer's ranks see them.
export_ifname() {
    if [[ -n "${FA_IFNAME:-}" ]]; then
        export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$FA_IFNAME}"
        export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$FA_IFNAME}"
    fi
    local name
    for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
        [[ -n "${!name:-}" ]] && say "$name=${!name}"
    done
    return 0
}

# run_ray_node ROLE FOREGROUND TIMEOUT_S ARGS...: `ray start ARGS --block` as this node's supervisor process.
# In the background (the default) it runs in its own session, so stop.sh can end it and everything it started as one
# process group; its pid goes to STATE/ROLE-N.pid and its output to STATE/ROLE-N.log (N: this script's pid), and this
# returns once Ray reports the node started (or fails with the log's tail). FOREGROUND=1 execs it instead (srun keeps
# the step alive while it blocks; Slurm's SIGTERM at the end of the step stops the node).
run_ray_node() {
    local role="$1" foreground="$2" timeout_s="$3" state
    shift 3
    state="$(state_dir "$FA_RAY_TEMP_DIR")"
    mkdir -p "$state"
    # Ray starts its workers at niceness 15 unless told otherwise; the trainer ranks and the engines are the job.
    export RAY_worker_niceness="${RAY_worker_niceness:-0}"
    say "ray start $* --block"
    if [[ "$foreground" == 1 ]]; then
        echo "$$" >"$state/$role-$$.pid"
        exec "$FA_RAY" start "$@" --block
    fi
    local log="$state/$role-$$.log" pid deadline # named after this script: known before the fork, unique here
    setsid "$FA_RAY" start "$@" --block >"$log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$state/$role-$$.pid"
    deadline=$((SECONDS + timeout_s))
    until grep -q "will now block forever" "$log"; do  # printed once the node is up and registered
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 30 "$log" >&2
            die "ray start exited before the node started (log: $log)"
        fi
        if ((SECONDS >= deadline)); then
            tail -n 30 "$log" >&2
            die "the node did not start within ${timeout_s}s (pid $pid still running; log: $log; stop it with stop.sh)"
        fi
        sleep 0.5
    done
    say "$role node started: pid $pid (process group $pid), log $log"
}
