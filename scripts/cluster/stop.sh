#!/usr/bin/env bash
# Stop the Ray nodes that start_head.sh / start_worker.sh started on this machine under one Ray temp dir, and only
# those (never `ray stop`, which ends every Ray process of the machine, other users' clusters included).
#
#   bash scripts/cluster/stop.sh [--temp-dir DIR] [--grace S]
#
#   --temp-dir DIR   the temp dir the nodes were started with (env FA_RAY_TEMP_DIR, default /tmp/ray)
#   --grace S        seconds a node gets to drain and stop its processes before they are killed (default 30)
#
# Each started node is one `ray start --block` process leading its own process group; its pid is in
# DIR/fully_async/ROLE-N.pid. SIGTERM makes it stop every process it started (GCS, raylet, dashboard, agents, Ray
# workers); whatever of that process group is still alive after the grace period gets SIGKILL. Then any process of
# this user whose command line names DIR (a Ray process of these nodes that left the group) gets the same treatment.
# Prints what it stopped; exit 0 when nothing is left, 1 otherwise.
set -euo pipefail
# shellcheck source=scripts/cluster/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

FA_RAY_TEMP_DIR="${FA_RAY_TEMP_DIR:-/tmp/ray}"
grace=30
while [[ $# -gt 0 ]]; do
    case "$1" in
    --temp-dir) need_value "$1" $# && FA_RAY_TEMP_DIR="$2" && shift 2 ;;
    --grace) need_value "$1" $# && grace="$2" && shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' && exit 0 ;;
    *) die "unknown flag $1 (see --help)" ;;
    esac
done
[[ -d "$FA_RAY_TEMP_DIR" ]] || die "no such temp dir: $FA_RAY_TEMP_DIR"
FA_RAY_TEMP_DIR="$(cd "$FA_RAY_TEMP_DIR" && pwd)"
state="$(state_dir "$FA_RAY_TEMP_DIR")"

# Live (not zombie) processes of a process group / whose command line names the temp dir, owned by this user.
group_pids() { ps -o pid=,stat= -g "$1" 2>/dev/null | awk '$2 !~ /^Z/ {print $1}'; }
# Ray's processes name the temp dir as --temp-dir=DIR / --temp_dir=DIR or a path under DIR/session_*; this script and
# its subshells name it only as a separate argument, so they never match.
# shellcheck disable=SC2001  # several characters to escape
escaped="$(sed 's/[][\\.^$*+?(){}|]/\\&/g' <<<"$FA_RAY_TEMP_DIR")"
tempdir_pids() {
    local pid
    for pid in $(pgrep -u "$(id -u)" -f -- "(temp[-_]dir=$escaped|$escaped/session_)" || true); do
        [[ "$(ps -o stat= -p "$pid" 2>/dev/null)" != Z* ]] && echo "$pid"
    done
    return 0
}

leaders=()
shopt -s nullglob
for pid_file in "$state"/*.pid; do
    pid="$(cat "$pid_file")"
    # Guard against a recycled pid: the recorded process must still be the `ray start` it was.
    if [[ "$pid" =~ ^[0-9]+$ ]] && ps -o args= -p "$pid" 2>/dev/null | grep -q "ray start"; then
        say "stopping $(basename "$pid_file" .pid) (pid $pid): SIGTERM"
        kill -TERM "$pid" 2>/dev/null || true
        leaders+=("$pid")
    else
        say "$(basename "$pid_file" .pid): not running"
    fi
    rm -f "$pid_file"
done
[[ ${#leaders[@]} -gt 0 ]] || say "no running node recorded under $state"

deadline=$((SECONDS + grace))
left() {
    local g
    for g in "${leaders[@]}"; do group_pids "$g"; done
    tempdir_pids
}
while [[ -n "$(left)" ]] && ((SECONDS < deadline)); do sleep 0.5; done

remaining="$(left | sort -un | tr '\n' ' ')"
if [[ -n "$remaining" ]]; then
    say "still running after ${grace}s, SIGKILL: $remaining"
    # shellcheck disable=SC2086  # a list of pids
    kill -KILL $remaining 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while [[ -n "$(left)" ]] && ((SECONDS < deadline)); do sleep 0.5; done
fi
remaining="$(left | sort -un | tr '\n' ' ')"
[[ -z "$remaining" ]] || die "processes still running: $remaining"
say "stopped: nothing of the nodes under $FA_RAY_TEMP_DIR is running"
