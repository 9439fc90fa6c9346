"""A hung engine node's server comes back (issue 38): on a loopback cluster of its own (tests/local_cluster.py: a head and
one worker), the driver tests/hung_recovery.py runs one engine server per node, the job's HostFactory and a real
EngineClient; every process of the worker node is stopped by SIGSTOP (pids found from its `ray start` process):

- stop-cont: the node continues before engine.hung_host_s: the server is restarted in place (same URL, on the
  worker), serves the current version, and the pool takes the next sync at full size;
- stop: the node stays stopped past engine.hung_host_s while Ray still reports it alive: the server is replaced on
  the head (the hung node avoided), serves the current version, counted as a replacement; the pool is back to two.

Both: the sync that met the hang went on with the head's server, which kept generating. The node is killed by pid
and the cluster stopped at the end; nothing is left running. The seconds from the stop to the server serving again
are measured by scripts/bench/hung_recovery.py (docs/benchmarks.md), not asserted here."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest

from tests.local_cluster import REPO, node_tree, script_env, signal_all, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_a_hung_node_s_server_is_restarted_in_place_when_it_continues_and_replaced_when_it_does_not(tmp_path):
    cluster = start_cluster(worker_gpus=(0,), cpus_per_node=4)
    (pid_file,) = cluster.state_dir.glob("worker-*.pid")
    leader = int(pid_file.read_text())
    try:
        env = script_env(RAY_ADDRESS=cluster.gcs_address, RUN_DIR=str(tmp_path), PYTHONPATH=str(REPO),
                         HUNG_LEADER=str(leader), SCENARIOS="stop-cont,stop", DEADLINE_S="2", HUNG_HOST_S="6",
                         CONT_AFTER_S="5")  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "tests.hung_recovery"], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=360)  # fmt: skip
    finally:
        signal_all(node_tree(leader), signal.SIGKILL)
        result, left = cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(line.removeprefix("RESULT "))
    assert result.returncode == 0 and not left, result.stdout

    for name in ("stop-cont", "stop"):
        row = out[name]
        # The sync that met the hang set the worker's server aside and went on; the head's server kept serving.
        assert row["down_after_sync"] == [1] and row["serving_after_sync"] == [0], (name, row)
        assert row["head_generate"]["versions"] == [2] * 3
        # Back at the current version, the pool at full size, and the next sync reached it.
        assert row["back_generate"] == {"servers": [row["url"]], "versions": [2] * 3}, (name, row)
        assert row["last_generate"]["versions"] == [3] * 3 and row["serving"] == [0, 1]
        assert row["restarts"] == 1, (name, row)
    cont, stop = out["stop-cont"], out["stop"]
    assert not cont["moved"] and cont["events"] == [] and cont["node_of_1"] == out["worker"]  # in place
    assert stop["moved"] and stop["events"] == [["replace", 1, stop["old_url"], stop["url"]]]
    assert stop["node_of_1"] == out["head"]  # not onto the hung node, which Ray still reported alive
