"""The same short default job in two or three layouts on this machine, alternating, in one invocation:

  one_node    python -m fully_async.runner on a local Ray (everything on the driver's node)
  two_node    the same overrides submitted with scripts/cluster/submit.sh to a 2-node loopback cluster started with
              the launch scripts (head: no GPUs; worker: 4 declared GPUs), placement.resources=gpu trainer.device=cpu:
              engine server and trainer rank on the worker node, HTTP between the nodes' processes
  baseline    (with --baseline DIR) one_node run from another checkout, e.g. the commit before the job module:
              `git worktree add /tmp/fa-base 079b99b && ln -s $PWD/.venv-engine /tmp/fa-base/.venv-engine`

    .venv/bin/python scripts/bench/cluster.py --steps 60 --pairs 2
    .venv/bin/python scripts/bench/cluster.py --steps 60 --pairs 2 --baseline /tmp/fa-base
    .venv/bin/python scripts/bench/cluster.py --spread --steps 40 --pairs 1 --set async_training.sync_mode=blocking

--spread (issue 27): two engine servers, on one node (local Ray) against one per node on the loopback cluster
(placement.resources=cpu placement.engine_cpus=5 with 8 logical CPUs per node: one server fits a node); the driver,
the trainer rank and server 0 on the head. --set KEY=VALUE adds an override to every layout's job.

Per layout: median seconds per step over the steps after --skip, mean weight-sync seconds and its reload phase,
last-20 mean reward, and the ratio of each layout's steps/s to one_node's (target: two_node within 10 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local loopback clusters only
sys.path.insert(0, str(REPO))  # tests/local_cluster.py runs the checkout's scripts/cluster/

from tests.local_cluster import start_cluster  # noqa: E402

SPREAD = ["engine.num_servers=2", "placement.resources=cpu", "placement.engine_cpus=5"]


def _overrides(steps: int, run_dir: Path, seed: int, extra: list[str]) -> list[str]:
    return [f"trainer.total_steps={steps}", f"hydra.run.dir={run_dir}", "logger=[jsonl]", f"seed={seed}", *extra]


def _run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> float:
    start = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed with {rc}; log {log}")
    return time.monotonic() - start


def summarize(run_dir: Path, skip: int) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["timing_s/step"] - r.get("timing_s/save_checkpoint", 0.0) for r in rows[skip:]]

    def mean(key: str) -> float:
        values = [r[key] for r in rows[skip:] if key in r]
        return statistics.fmean(values) if values else float("nan")

    return {
        "step_s": statistics.median(steps),
        "update_s": mean("timing_s/update"),
        "sync_s": mean("timing_s/param_sync"),  # the trainer's wait: in background mode its export (or stage) only
        "distribute_s": mean("timing_s/param_sync/distribute"),
        "reload_s": mean("timing_s/param_sync/reload"),
        "reward_last20": statistics.fmean(r["reward/mean"] for r in rows[-20:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the per-step figures (start-up)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="another checkout to run the one_node job from")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--spread", action="store_true", help="two engine servers, one per node (see above)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every job")
    args = ap.parse_args()
    extra = (SPREAD if args.spread else []) + args.set
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    out.mkdir(parents=True, exist_ok=True)
    py = str(REPO / ".venv" / "bin" / "python")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    cluster = start_cluster(worker_gpus=(0,) if args.spread else (4,))
    results: dict[str, list[dict[str, float]]] = {}
    try:
        for pair in range(args.pairs):
            layouts = ["one_node", "two_node"] + (["baseline"] if args.baseline else [])
            if pair % 2:
                layouts.reverse()  # alternate the order: drift on a noisy machine hits every layout alike
            for layout in layouts:
                run_dir = out / f"{layout}_{pair}"
                over = _overrides(args.steps, run_dir, pair, extra)
                if layout == "two_node":
                    gpu = [] if args.spread else ["placement.resources=gpu", "trainer.device=cpu"]
                    cluster.submit("--", *over, *gpu, timeout=1800)
                    wall = float("nan")
                elif layout == "baseline":
                    benv = {**env, "PYTHONPATH": str(args.baseline)}
                    cmd = [py, "-m", "fully_async.runner", *over]
                    wall = _run(cmd, benv, args.baseline, out / f"{layout}_{pair}.log")
                else:
                    wall = _run([py, "-m", "fully_async.runner", *over], env, REPO, out / f"{layout}_{pair}.log")
                row = summarize(run_dir, args.skip) | {"wall_s": wall}
                if layout == "two_node":
                    record = json.loads((run_dir / "placement.json").read_text())
                    row["engine_nodes"] = sorted({e["node_id"][:8] for e in record["engines"]})
                results.setdefault(layout, []).append(row)
                print(f"{layout} pair {pair}: " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    finally:
        result, left = cluster.stop()
        if left:
            print(f"warning: stop.sh left {left}", file=sys.stderr)
    base = statistics.fmean(r["step_s"] for r in results["one_node"])
    cols = ["update_s", "sync_s", "distribute_s", "reload_s", "reward_last20"]
    print(f"\n{'layout':10} {'s/step':>8} {'steps/s vs one_node':>20} " + " ".join(f"{c:>13}" for c in cols))
    for layout, rows in results.items():
        step = statistics.fmean(r["step_s"] for r in rows)
        means = " ".join(f"{statistics.fmean(r[c] for r in rows):13.3f}" for c in cols)
        print(f"{layout:10} {step:8.3f} {base / step:20.3f} {means}")
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
