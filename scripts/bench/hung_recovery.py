"""From an engine node's hang (or death) to its server serving again: seconds, per scenario, side by side in one run.

Per run a fresh 2-node loopback cluster (tests/local_cluster.py) and the driver tests/hung_recovery.py on the head: one
engine server per node (fake engine processes under EngineHost actors: hosts, placement groups, the control plane
and the client's recovery are the real ones), the worker node stopped (SIGSTOP) or killed (SIGKILL) by pid:

  kill       every process of the worker killed: its server is replaced on the head
  stop-ray   stopped, engine.hung_host_s far away: replaced once Ray declares the node dead
  stop       stopped, engine.hung_host_s=--hung-host: replaced after our own bound
  stop-cont  stopped, continued after --cont-after s: restarted in place

    .venv/bin/python scripts/bench/hung_recovery.py                      # all four
    .venv/bin/python scripts/bench/hung_recovery.py --scenarios stop,kill

Prints one JSON line per scenario: stop_to_serving_s (the stop to the server's first generation at the current
version), back_s (to its slot serving), moved, restarts, failed_tries.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local loopback clusters only
sys.path.insert(0, str(REPO))  # tests/local_cluster.py runs the checkout's scripts/cluster/

from tests.local_cluster import node_tree, script_env, signal_all, start_cluster  # noqa: E402


def measure(scenario: str, args: argparse.Namespace) -> dict:
    cluster = start_cluster(worker_gpus=(0,), cpus_per_node=4)
    (pid_file,) = cluster.state_dir.glob("worker-*.pid")
    leader = int(pid_file.read_text())
    run_dir = Path(tempfile.mkdtemp(prefix="fa-hung-recovery-"))
    hung_host_s = 600.0 if scenario == "stop-ray" else args.hung_host
    try:
        env = script_env(RAY_ADDRESS=cluster.gcs_address, RUN_DIR=str(run_dir), PYTHONPATH=str(REPO),
                         HUNG_LEADER=str(leader), SCENARIOS=scenario.replace("stop-ray", "stop"),
                         DEADLINE_S=str(args.deadline), HUNG_HOST_S=str(hung_host_s),
                         CONT_AFTER_S=str(args.cont_after))  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "tests.hung_recovery"], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
    finally:
        signal_all(node_tree(leader), signal.SIGKILL)
        cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"driver failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    out = json.loads(line.removeprefix("RESULT "))
    return out[scenario.replace("stop-ray", "stop")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="kill,stop-ray,stop,stop-cont")
    parser.add_argument("--deadline", type=float, default=10.0, help="engine.control_deadline_s")
    parser.add_argument("--hung-host", type=float, default=30.0, help="engine.hung_host_s for `stop`")
    parser.add_argument("--cont-after", type=float, default=20.0, help="`stop-cont`: SIGCONT this long after the stop")
    args = parser.parse_args()
    for scenario in args.scenarios.split(","):
        row = measure(scenario, args)
        print(json.dumps({"scenario": scenario, "stop_to_serving_s": round(row["stop_to_serving_s"], 1),
                          "back_s": round(row["back_s"], 1), "moved": row["moved"], "restarts": row["restarts"],
                          "failed_tries": row["failed_tries"], "deadline_s": row["deadline_s"],
                          "hung_host_s": row["hung_host_s"]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
