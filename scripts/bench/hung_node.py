"""What a hung engine node costs the trainer: the blocked time (pause to resume) of the weight sync that meets it.

Per scenario, a fresh 2-node loopback cluster (tests/local_cluster.py: a head and one worker) and the driver
tests/hung_node.py on the head: one engine server per node (fake engine processes under EngineHost actors: the
control plane, hosts, the disk transport's copy through Ray and ParamSync are the real ones), the sim backend; the
worker node is stopped with SIGSTOP of its processes (found from the pid its start script recorded):

  before   the node stops between two syncs: the next sync meets it at its pause
  during   the node stops right after a sync's pause: the sync meets it in the copy to its node and the reload

`--code DIR` runs the same driver against another checkout (e.g. `git archive <commit> | tar -x -C DIR`), so the
code before a change and after it are measured on the same machine with the same script:

    .venv/bin/python scripts/bench/hung_node.py                       # this checkout
    .venv/bin/python scripts/bench/hung_node.py --code /tmp/old-code  # another one

Prints one JSON line per scenario: blocked_s (timing_s/param_sync), the phases, and after_s (the next sync, the node
still stopped).
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


def measure(code: Path, scenario: str, args: argparse.Namespace) -> dict:
    """One scenario on a fresh cluster, the driver importing `code`'s fully_async; the driver's RESULT."""
    cluster = start_cluster(worker_gpus=(0,), cpus_per_node=4)
    (pid_file,) = cluster.state_dir.glob("worker-*.pid")
    leader = int(pid_file.read_text())
    run_dir = Path(tempfile.mkdtemp(prefix="fa-hung-"))
    try:
        env = script_env(RAY_ADDRESS=cluster.gcs_address, RUN_DIR=str(run_dir), PYTHONPATH=str(code),
                         HUNG_LEADER=str(leader), SCENARIOS=scenario, DEADLINE_S=str(args.deadline),
                         CONTROL_TIMEOUT_S=str(args.control_timeout), SYNC_TIMEOUT_S=str(args.sync_timeout))  # fmt: skip
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "hung_node.py")], env=env, cwd=code,
                              capture_output=True, text=True, timeout=args.sync_timeout * 3 + 120)  # fmt: skip
    finally:
        signal_all(node_tree(leader), signal.SIGKILL)
        cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / f"{code.name}-{scenario}.log").write_text(proc.stderr)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"driver failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", type=Path, default=REPO, help="checkout whose fully_async the driver runs")
    parser.add_argument("--scenarios", default="before,during")
    parser.add_argument("--deadline", type=float, default=10.0, help="engine.control_deadline_s (where it exists)")
    parser.add_argument("--control-timeout", type=float, default=60.0, help="engine.control_timeout_s")
    parser.add_argument("--logs", type=Path, help="keep each driver's log (timestamped warnings) in this folder")
    parser.add_argument("--sync-timeout", type=float, default=300.0, help="advanced.sync_timeout_s")
    args = parser.parse_args()
    for scenario in args.scenarios.split(","):
        out = measure(args.code.resolve(), scenario, args)
        row = out[scenario]
        print(json.dumps({"code": str(args.code), "scenario": scenario, "blocked_s": round(row["blocked_s"], 2),
                          "phases": {k.rsplit("/", 1)[-1]: round(v, 2) for k, v in row["phases"].items()},
                          "after_s": round(out["after_s"], 2), "deadline_s": args.deadline,
                          "control_timeout_s": args.control_timeout}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
