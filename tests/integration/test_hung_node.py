"""A hung engine node costs one weight sync about engine.control_deadline_s, not minutes (issue 27).

A loopback cluster of its own (tests/local_cluster.py: a head and one worker; not the session's, whose worker later tests
need alive), the driver tests/hung_node.py on the head with one engine server per node: the worker node is stopped
by SIGSTOP of its `ray start` process and every descendant (pids found from the one the start script recorded):

- before a sync: the sync's pause sets the worker's server aside after the deadline (down, handed to the pool's
  on_dead) and the sync finishes on the head's server within the deadline and a few seconds;
- after a sync's pause: the copy to the worker's node is abandoned after the deadline (its server set aside at the
  reload, never called) and the sync again finishes within the deadline and a few seconds;
- the run goes on: with the node still stopped the next sync does not call the down server (nothing reached it after
  its last restart, checked once the node continues) and the head's server generates at the latest version.
At the end the node continues, the transport's close leaves no node-local root (the abandoned copy finished first),
and the node is killed by pid and the cluster stopped.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest

from tests.local_cluster import REPO, node_tree, script_env, signal_all, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEADLINE_S = 4.0
SLACK_S = 4.0
"""What a sync that meets the hung node may take beyond the deadline (the pause, copy, reload and resume of the live
server, and the probe period)."""


def test_a_hung_node_costs_a_sync_the_deadline_not_minutes(tmp_path):
    cluster = start_cluster(worker_gpus=(0,), cpus_per_node=4)
    (pid_file,) = cluster.state_dir.glob("worker-*.pid")  # the worker's `ray start --block`, as its script wrote it
    leader = int(pid_file.read_text())
    try:
        env = script_env(RAY_ADDRESS=cluster.gcs_address, RUN_DIR=str(tmp_path), PYTHONPATH=str(REPO),
                         HUNG_LEADER=str(leader), DEADLINE_S=str(DEADLINE_S), CONTROL_TIMEOUT_S="60",
                         SYNC_TIMEOUT_S="120")  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "tests.hung_node"], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=240)  # fmt: skip
    finally:
        signal_all(node_tree(leader), signal.SIGKILL)  # the worker node, by the pids its start recorded
        result, left = cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(line.removeprefix("RESULT "))
    assert result.returncode == 0 and not left, result.stdout

    before, during = out["before"], out["during"]
    # Stopped between syncs: the pause meets it, sets it aside; the sync ends within the deadline and a few seconds.
    assert DEADLINE_S <= before["blocked_s"] < DEADLINE_S + SLACK_S, before
    assert before["phases"]["timing_s/param_sync/pause"] >= DEADLINE_S
    assert before["handed"] == [1] and before["serving"] == [0] and before["node_dirs"] == {}
    # Stopped after the pause: the copy to its node is abandoned, its server set aside at the reload.
    assert DEADLINE_S <= during["blocked_s"] < DEADLINE_S + SLACK_S, during
    assert during["phases"]["timing_s/param_sync/distribute"] >= DEADLINE_S
    assert during["handed"] == [1] and during["serving"] == [0] and during["node_dirs"] == {out["worker"]: None}
    # Neither that reload nor the next sync (the node still stopped) called the down server: nothing reached it after
    # its restart before `during` (a call sent while it was stopped would have been served once it continued).
    assert out["worker_at_end"] == out["worker_at_restart"] and out["worker_at_end"]["reloads"]
    # The run goes on: the live server serves the latest version.
    assert out["after_generate"]["versions"] == [out["version"]] * 3
    # The copy abandoned while the node was stopped finished once it continued, before the close removed its root.
    assert out["roots_after_close"] == []
