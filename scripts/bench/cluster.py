"""The same short default job in two or three layouts on this machine, alternating, in one invocation:

  one_node    python -m fully_async.runner on a local Ray (everything on the driver's node)
  two_node    the same overrides submitted with scripts/cluster/submit.sh to a 2-node loopback cluster started with
              the launch scripts (head: no GPUs; worker: 4 declared GPUs), placement.resources=gpu trainer.device=cpu:
              engine server and trainer rank on the worker node, HTTP between the nodes' processes
  baseline    (with --baseline DIR) one_node run from another checkout, e.g. the commit before the job module:
              `git worktree add /tmp/fa-base 079b99b && ln -s $PWD/.venv-engine /tmp/fa-base/.venv-engine`

    .venv/bin/python scripts/bench/cluster.py --steps 60 --pairs 2
    .venv/bin/python scripts/bench/cluster.py --steps 60 --pairs 2 --baseline /tmp/fa-base

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
sys.path.insert(0, str(REPO))  # tests.cluster: the repository's test helpers
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local loopback clusters only

from tests.cluster import start_cluster  # noqa: E402


def _overrides(steps: int, run_dir: Path, seed: int) -> list[str]:
    return [f"trainer.total_steps={steps}", f"hydra.run.dir={run_dir}", "logger=[jsonl]", f"seed={seed}"]


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
    syncs = [r["timing_s/param_sync"] for r in rows[skip:] if "timing_s/param_sync" in r]
    reloads = [r["timing_s/param_sync/reload"] for r in rows[skip:] if "timing_s/param_sync/reload" in r]
    return {
        "step_s": statistics.median(steps),
        "sync_s": statistics.fmean(syncs) if syncs else float("nan"),
        "reload_s": statistics.fmean(reloads) if reloads else float("nan"),
        "reward_last20": statistics.fmean(r["reward/mean"] for r in rows[-20:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the per-step figures (start-up)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="another checkout to run the one_node job from")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    out.mkdir(parents=True, exist_ok=True)
    py = str(REPO / ".venv" / "bin" / "python")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    cluster = start_cluster(worker_gpus=(4,))
    results: dict[str, list[dict[str, float]]] = {}
    try:
        for pair in range(args.pairs):
            layouts = ["one_node", "two_node"] + (["baseline"] if args.baseline else [])
            if pair % 2:
                layouts.reverse()  # alternate the order: drift on a noisy machine hits every layout alike
            for layout in layouts:
                run_dir = out / f"{layout}_{pair}"
                over = _overrides(args.steps, run_dir, pair)
                if layout == "two_node":
                    cluster.submit("--", *over, "placement.resources=gpu", "trainer.device=cpu", timeout=1800)
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
    print(f"\n{'layout':10} {'s/step':>8} {'steps/s vs one_node':>20} {'sync s':>8} {'reload s':>9} {'last-20':>8}")
    for layout, rows in results.items():
        step = statistics.fmean(r["step_s"] for r in rows)
        print(
            f"{layout:10} {step:8.3f} {base / step:20.3f} {statistics.fmean(r['sync_s'] for r in rows):8.3f} "
            f"{statistics.fmean(r['reload_s'] for r in rows):9.3f} {statistics.fmean(r['reward_last20'] for r in rows):8.3f}"
        )
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
