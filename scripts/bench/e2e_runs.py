"""Tables of finished runs of the built-in task (docs/benchmarks.md, issue 4): time to reward levels, unlearned answers.

    .venv/bin/python scripts/bench/e2e_runs.py /tmp/e2e/t5_eta1_s* /tmp/e2e/t5_eta0_s* --pair eta1 eta0

One row per run directory, from its metrics.jsonl, trajectories.jsonl and .hydra/config.yaml. Seconds are
training-loop seconds (the sum of `timing_s/step`; start-up is not in them); "first 10" = the mean reward of the
first ten steps (about the untrained policy's); "reached" = the first 20-step mean reward at or above the level;
"stuck" = answers (ground truths of the built-in task) whose trajectories of the last 100 steps average below 0.5.
With --pair A B, runs whose names differ only in A and B are compared: the common level is the lower of the two
last-20 means less 0.02, a reward both runs reach, and each run's seconds to it.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import yaml

from fully_async.data import synthetic_rows
from fully_async.protocol import PromptRef
from fully_async.report import read_jsonl

LEVELS = (0.8, 0.9, 0.95)


def load(run: Path) -> dict:
    metrics = read_jsonl(run / "metrics.jsonl")
    if len(metrics) < 20:
        raise SystemExit(f"{run}: {len(metrics)} steps in metrics.jsonl, need at least 20")
    rewards = [m["reward/mean"] for m in metrics]
    elapsed, t = [], 0.0
    for m in metrics:
        t += m["timing_s/step"]
        elapsed.append(t)
    means = [statistics.mean(rewards[i - 19 : i + 1]) for i in range(19, len(rewards))]
    data = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["data"]
    if data.get("train_files"):
        raise SystemExit(f"{run}: trained on {data['train_files']}, not the built-in task")
    truth = [
        r.ground_truth for r in synthetic_rows(data["synthetic_size"], data["seed"], "train", data["synthetic_task"])
    ]
    last = metrics[-1]["step"] - 100
    per_answer: dict[str, list[float]] = defaultdict(list)
    for t_ in read_jsonl(run / "trajectories.jsonl"):
        if t_["step"] > last:
            per_answer[truth[PromptRef.parse(t_["prompt_uid"]).index]].append(t_["reward"])
    return {
        "name": run.name,
        "steps": len(metrics),
        "seconds": elapsed[-1],
        "step_s": elapsed[-1] / len(metrics),
        "elapsed": elapsed,
        "means": means,
        "first10": statistics.mean(rewards[:10]),
        "last20": means[-1],
        "stuck": sorted(a for a, r in per_answer.items() if statistics.mean(r) < 0.5),
    }


def reached(run: dict, level: float) -> float | None:
    """Training seconds until the 20-step mean reward first reaches `level`, or None."""
    return next((run["elapsed"][i + 19] for i, m in enumerate(run["means"]) if m >= level), None)


def mean_at(run: dict, seconds: float) -> float | None:
    """The 20-step mean reward at `seconds` of training, or None when the run had ended (or not yet 20 steps)."""
    if seconds > run["elapsed"][-1]:
        return None
    i = next(i for i, t in enumerate(run["elapsed"]) if t >= seconds)
    return run["means"][i - 19] if i >= 19 else None


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--pair", nargs=2, metavar=("A", "B"), help="compare runs named alike but for A / B")
    p.add_argument("--at", type=float, nargs="*", default=[30, 60, 90, 120, 150, 180, 210], help="training seconds")
    p.add_argument("--levels", type=float, nargs="*", default=list(LEVELS), help="reward levels to time")
    args = p.parse_args()
    levels = tuple(args.levels)
    runs = {r.name: load(r) for r in args.runs}
    header = " | ".join(f"{lv} reached, s" for lv in levels)
    print(f"| run | steps | training s | mean step, s | first 10 | {header} | last 20 | stuck answers |")
    print("|---" * (7 + len(levels)) + "|")
    for r in runs.values():
        at = " | ".join(_s(reached(r, lv)) for lv in levels)
        stuck = f"{len(r['stuck'])} ({','.join(r['stuck'])})" if r["stuck"] else "0"
        print(
            f"| {r['name']} | {r['steps']} | {r['seconds']:.0f} | {r['step_s']:.3f} | {r['first10']:.3f} | {at} | {r['last20']:.3f} | {stuck} |"
        )
    if not args.pair:
        return
    a, b = args.pair
    pairs = [
        (r, runs[r["name"].replace(a, b)]) for r in runs.values() if a in r["name"] and r["name"].replace(a, b) in runs
    ]
    if not pairs:
        raise SystemExit(f"no run pairs named alike but for {a!r} / {b!r}")
    print(f"\n| pair | common level | {a}: s | {b}: s | faster |")
    print("|---|---|---|---|---|")
    wins, times_a, times_b = 0, [], []
    for x, y in pairs:
        level = min(x["last20"], y["last20"]) - 0.02
        tx, ty = reached(x, level), reached(y, level)
        first = tx is not None and (ty is None or tx < ty)
        times_a.append(tx)
        times_b.append(ty)
        wins += first
        print(f"| {x['name']} | {level:.2f} | {_s(tx)} | {_s(ty)} | {a if first else b} |")
    sides = ((a, [x for x, _ in pairs]), (b, [y for _, y in pairs]))
    for label, side in sides:
        last = [r["last20"] for r in side]
        sem = statistics.stdev(last) / len(last) ** 0.5 if len(last) > 1 else 0.0
        hits = {lv: [t for r in side if (t := reached(r, lv)) is not None] for lv in levels}
        at = ", ".join(
            f"{lv} by {len(h)}" + (f" (median {statistics.median(h):.0f} s)" if h else "") for lv, h in hits.items()
        )
        print(
            f"{label}: {len(side)} runs, last20 {statistics.mean(last):.3f} +- {sem:.3f}, median step "
            f"{statistics.median(r['step_s'] for r in side):.3f} s, median {statistics.median(r['seconds'] for r in side):.0f} s "
            f"in all, {at}, stuck answers {sum(len(r['stuck']) for r in side)} in {sum(bool(r['stuck']) for r in side)} runs"
        )
    print(f"{a} reaches the common level first in {wins} of {len(pairs)} pairs", end="")
    if all(t is not None for t in times_a + times_b):
        ratio = statistics.geometric_mean([x / y for x, y in zip(times_a, times_b)])
        print(
            f" (median {statistics.median(times_a):.0f} s against {statistics.median(times_b):.0f} s, mean "
            f"{statistics.mean(times_a):.0f} against {statistics.mean(times_b):.0f} s, geometric mean of the ratio "
            f"{ratio:.2f})",
            end="",
        )
    print()
    print("\n| mean 20-step reward at training s | " + " | ".join(f"{t:.0f}" for t in args.at) + " |")
    print("|---" * (1 + len(args.at)) + "|")
    for label, side in sides:
        cells = []
        for t in args.at:
            vals = [v for r in side if (v := mean_at(r, t)) is not None]
            cells.append(
                "-"
                if not vals
                else f"{statistics.mean(vals):.3f}" + ("" if len(vals) == len(side) else f" ({len(vals)} runs)")
            )
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
