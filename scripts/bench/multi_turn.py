"""The multi-turn built-in task (data.synthetic_task=guess) at max_staleness 1 vs 0 with a slow environment
(docs/benchmarks.md, issue 18).

    .venv/bin/python scripts/bench/multi_turn.py run --seeds 1 2 --steps 120 --out /tmp/mt
    .venv/bin/python scripts/bench/multi_turn.py plot /tmp/mt/eta1_s* /tmp/mt/eta0_s* --png docs/img/guess_eta.png
    .venv/bin/python scripts/bench/e2e_runs.py /tmp/mt/eta1_s* /tmp/mt/eta0_s* --pair eta1 eta0 --levels 0.5 0.6 0.7

`run` starts the runner once per (seed, eta), one after the other (eta 1 then 0 for each seed), or with --together
the etas of one seed at the same time (on a machine whose load changes, the only way both see it alike); every run uses the guess task with `--delay` seconds per environment answer. `plot` draws the mean
20-step reward against training seconds (the sum of timing_s/step: start-up excluded) per eta, each seed thin.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TASK = ["data.synthetic_task=guess", "logger=[jsonl]"]
"""The guess task: its own settings (two one-token guesses, room for the environment's answer between them) come with
it (fully_async/config/task/guess.yaml)."""


def run(args: argparse.Namespace) -> None:
    delay = f"data.synthetic_env_delay_s=[{args.delay[0]},{args.delay[1]}]"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        started = []
        for eta in args.etas:
            out = args.out / f"eta{eta}_s{seed}"
            if (out / "metrics.jsonl").exists():
                print(f"{out}: exists, skipped", flush=True)
                continue
            cmd = [sys.executable, "-m", "fully_async.runner", *TASK, delay, f"seed={seed}",
                   f"async_training.max_staleness={eta}", f"trainer.total_steps={args.steps}",
                   f"hydra.run.dir={out}", *args.extra]  # fmt: skip
            print(" ".join(cmd), flush=True)
            with open(args.out / f"eta{eta}_s{seed}.log", "w") as log:
                started.append((out, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)))
            if not args.together:
                _wait(started)
                started = []
        _wait(started)


def _wait(started: list[tuple[Path, subprocess.Popen]]) -> None:
    """Wait for every started run; stop at the first that failed (its log says why)."""
    failed = [out for out, proc in started if proc.wait() != 0]
    if failed:
        raise SystemExit(f"run(s) failed: {', '.join(map(str, failed))} (see the .log beside each)")


def curve(run_dir: Path) -> tuple[list[float], list[float]]:
    """(training seconds, 20-step mean reward) per step from the 20th on."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    t, xs, rewards = 0.0, [], []
    for r in rows:
        t += r["timing_s/step"]
        xs.append(t)
        rewards.append(r["reward/mean"])
    means = [statistics.mean(rewards[i - 19 : i + 1]) for i in range(19, len(rewards))]
    return xs[19:], means


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = {"eta1": "tab:blue", "eta0": "tab:orange"}
    for label, colour in colours.items():
        runs = [r for r in args.runs if r.name.startswith(label + "_")]
        for r in runs:
            xs, ys = curve(r)
            ax.plot(xs, ys, color=colour, alpha=0.35, linewidth=1)
        if runs:
            ax.plot([], [], color=colour, label=f"max_staleness={label[-1]} ({len(runs)} seeds)")
    ax.axhline(
        args.random_level, color="gray", linestyle=":", label=f"uniformly random digits ({args.random_level:.2f})"
    )
    ax.axhline(0.2, color="black", linestyle="--", linewidth=0.8, label="best without the answer (0.20)")
    ax.set_xlabel("training seconds (start-up excluded)")
    ax.set_ylabel("reward, 20-step mean")
    ax.set_title("guess task: two one-digit guesses, the environment answers after 50-500 ms")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=100)
    print(args.png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    r.add_argument("--etas", type=int, nargs="+", default=[1, 0])
    r.add_argument("--steps", type=int, default=120)
    r.add_argument("--delay", type=float, nargs=2, default=[0.05, 0.5], metavar=("LOW", "HIGH"))
    r.add_argument("--out", type=Path, default=Path("/tmp/mt"))
    r.add_argument("--together", action="store_true", help="run the etas of one seed at the same time")
    r.add_argument("extra", nargs="*", help="more runner overrides")
    g = sub.add_parser("plot")
    g.add_argument("runs", nargs="+", type=Path)
    g.add_argument("--png", type=Path, required=True)
    g.add_argument("--random-level", type=float, default=0.19, help="uniformly random digits, two turns")
    args = p.parse_args()
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        run(args)
    else:
        plot(args)


if __name__ == "__main__":
    main()
