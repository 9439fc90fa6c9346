"""The default job with the weight sync in the background against the blocking sync, side by side (issue 26).

    .venv/bin/python scripts/bench/background_sync.py --seeds 0 1 2 3 --out /tmp/bgsync
    .venv/bin/python scripts/bench/background_sync.py --out /tmp/bgsync --table-only     # the table of finished runs
    .venv/bin/python scripts/bench/background_sync.py --seeds 0 1 --steps 200 --baseline /tmp/fa-base --out /tmp/gap

--baseline DIR (issue 51): instead of blocking against background, this checkout's background sync against the same
job run from another checkout (`git worktree add /tmp/fa-base COMMIT`; the same venvs run both), alternating, so a
change of the trainer's loop is measured side by side; the third table splits the trainer's time between two
updates by the trace's trainer spans (the waits for a batch, the sync's start and read, the step's stats call) and
what no span covers.

For each seed, the default job (`python -m fully_async.runner`, jsonl logger only) runs once with
async_training.sync_mode=blocking and once with background, one after the other (the order alternates by seed so a
drift of the machine's load does not favour one mode). From each run's metrics.jsonl, over its steps after the first
(the first waits for the engine's warm-up) and leaving out checkpoint writes: seconds per step, the update's seconds
(log-probs + train + prepare), their ratio (1.0 = the trainer never waits for anything but its own update), the
seconds per step the trainer was held by weight syncs (`timing_s/param_sync`: background = its export and any wait
for the previous sync), waited for a batch, and spent otherwise (the rest of the step), by its per-step stats calls
(from the trace, when written), the groups dropped as too stale, the last-20 mean reward and
the training seconds until the 20-step mean reward first reached 0.8. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from e2e_runs import load as learning_curve  # scripts/bench is on sys.path when this runs as a script
from e2e_runs import reached

from fully_async.report import read_jsonl
from fully_async.trace import load

REPO = Path(__file__).resolve().parents[2]
MODES = ("blocking", "background")
GAP_SPANS = ("wait_for_batch", "param_sync", "stats", "save_checkpoint")
"""The trainer spans that fall between two updates (trainer.py)."""
LEVEL = 0.8


def run(out: Path, mode: str, seed: int, steps: int, extra: list[str], checkout: Path = REPO) -> float:
    """One default job from `checkout` (mode "baseline": the background sync there); returns its wall seconds. Its
    console output goes to out/stdout.log."""
    out.mkdir(parents=True, exist_ok=True)
    mode = "background" if mode == "baseline" else mode
    cmd = [sys.executable, "-m", "fully_async.runner", f"hydra.run.dir={out}", f"seed={seed}",
           f"async_training.sync_mode={mode}", f"trainer.total_steps={steps}", "logger.backends=[jsonl]",
           *extra]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_memory_monitor_refresh_ms": "0",
           "PYTHONPATH": str(checkout)}  # fmt: skip
    start = time.monotonic()
    with open(out / "stdout.log", "w") as log:
        proc = subprocess.run(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{out}: the run failed (exit {proc.returncode}); see {out / 'stdout.log'}")
    return time.monotonic() - start


def from_trace(run_dir: Path) -> tuple[list[float], float]:
    """From the event trace (nothing when none was written): the seconds of the trainer's `stats` span per step, and
    the seconds of the trainer's waits for a batch that fell while the engines were paused for a sync (the rollouter's
    `paused` spans), in all."""
    try:
        spans, _ = load(run_dir)
    except (OSError, ValueError):
        return [], float("nan")
    trainer = [s for s in spans if s.lane == "trainer"]
    paused = [(s.start, s.start + s.dur) for s in spans if s.lane == "rollouter" and s.name == "paused"]
    overlap = sum(
        max(0.0, min(w.start + w.dur, end) - max(w.start, start))
        for w in trainer
        if w.name == "wait_for_batch"
        for start, end in paused
    )
    return [s.dur for s in trainer if s.name == "stats"], overlap


def between_updates(run_dir: Path) -> dict[str, float]:
    """The trainer's seconds between one update's end and the next one's start, per step (mean), split by the trainer
    spans that fall in that gap (clipped to it) and `untraced`, the rest; {} without a trace."""
    try:
        spans, _ = load(run_dir)
    except (OSError, ValueError):
        return {}
    trainer = sorted((s for s in spans if s.lane == "trainer"), key=lambda s: s.start)
    updates = [s for s in trainer if s.name == "update"]
    gaps = list(zip((u.end for u in updates), (u.start for u in updates[1:])))
    if not gaps:
        return {}
    tops = [s for s in trainer if s.name in GAP_SPANS]
    split = dict.fromkeys(GAP_SPANS, 0.0)
    for start, end in gaps:
        for s in tops:
            split[s.name] += max(0.0, min(s.end, end) - max(s.start, start))
    total = sum(end - start for start, end in gaps)
    split["untraced"] = total - sum(split.values())
    return {"gap": total / len(gaps)} | {k: v / len(gaps) for k, v in split.items()}


def summarize(run_dir: Path) -> dict:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    rest = metrics[1:]
    step = [m["timing_s/step"] - m.get("timing_s/save_checkpoint", 0.0) for m in rest]
    update = [m["timing_s/update"] for m in rest]
    curve = learning_curve(run_dir)
    stats, paused = from_trace(run_dir)
    sync = [m.get("timing_s/param_sync", 0.0) for m in rest]
    batch = [m["timing_s/wait_for_batch"] for m in rest]
    return {
        "name": run_dir.name,
        "steps": len(metrics),
        "step_s": statistics.mean(step),
        "update_s": statistics.mean(update),
        "ratio": sum(step) / sum(update),
        "sync_s": statistics.mean(sync),
        "batch_s": statistics.mean(batch),
        "paused_s": paused / len(metrics),
        "other_s": (sum(step) - sum(update) - sum(sync) - sum(batch)) / len(rest),
        "stale": metrics[-1].get("fully_async/count/dropped_stale", 0),
        "stats_s": statistics.mean(stats) if stats else float("nan"),
        "last20": curve["last20"],
        "reached": reached(curve, LEVEL),
        "between": between_updates(run_dir),
    }


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] +
                     ["| " + " | ".join(r) + " |" for r in rows])  # fmt: skip


def per_run(rows: list[dict]) -> str:
    """Where each step's time went besides the update: held by syncs, waiting for a batch (and how much of that wait
    fell while the engines were paused for a sync), the rest (stats, logging, the step's own bookkeeping); and the
    groups the queue dropped as too stale (each one regenerated)."""
    columns = ["run", "steps", "s per step", "update s", "step / update", "held by sync, s", "wait for batch, s",
               "of it engines paused, s", "other, s", "stats, s", "stale drops", "last 20",
               f"{LEVEL} reached, s"]  # fmt: skip
    return markdown(columns, [
        [r["name"], str(r["steps"]), f"{r['step_s']:.3f}", f"{r['update_s']:.3f}", f"{r['ratio']:.2f}",
         f"{r['sync_s']:.3f}", f"{r['batch_s']:.3f}", f"{r['paused_s']:.3f}", f"{r['other_s']:.3f}",
         f"{r['stats_s']:.3f}",
         str(r["stale"]), f"{r['last20']:.3f}", "-" if r["reached"] is None else f"{r['reached']:.0f}"]
        for r in rows
    ])  # fmt: skip


def per_mode(rows: list[dict]) -> str:
    columns = ["mode", "runs", "s per step (mean)", "step / update (mean)", "held by sync, s", "last 20 (mean)",
               f"{LEVEL} reached, s (median of those that did)"]  # fmt: skip
    out = []
    for mode in (*MODES, "baseline"):
        rs = [r for r in rows if r["name"].startswith(mode)]
        if not rs:
            continue
        hit = [r["reached"] for r in rs if r["reached"] is not None]
        med = f"{statistics.median(hit):.0f} ({len(hit)} of {len(rs)})" if hit else f"- (0 of {len(rs)})"
        mean = {k: statistics.mean(r[k] for r in rs) for k in ("step_s", "ratio", "sync_s", "last20")}
        out.append([mode, str(len(rs)), f"{mean['step_s']:.3f}", f"{mean['ratio']:.2f}", f"{mean['sync_s']:.3f}",
                    f"{mean['last20']:.3f}", med])  # fmt: skip
    return markdown(columns, out)


def gaps(rows: list[dict]) -> str:
    """Where the trainer's time between two updates went (seconds per step, from the trace)."""
    columns = ["run", "between updates, s", *(f"{k}, s" for k in GAP_SPANS), "untraced, s"]
    return markdown(columns, [
        [r["name"], f"{r['between']['gap']:.4f}", *(f"{r['between'][k]:.4f}" for k in (*GAP_SPANS, "untraced"))]
        for r in rows if r["between"]
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=100, help="trainer.total_steps (the default job's: 100)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bgsync"))
    parser.add_argument("--table-only", action="store_true", help="summarise the runs already under --out")
    parser.add_argument("--baseline", type=Path, help="another checkout: its background sync against this one's")
    parser.add_argument("overrides", nargs="*", help="further key=value overrides for every run")
    args = parser.parse_args()
    modes = ("baseline", "background") if args.baseline else MODES
    if not args.table_only:
        for seed in args.seeds:
            order = modes if seed % 2 == 0 else tuple(reversed(modes))
            for mode in order:
                checkout = args.baseline if mode == "baseline" else REPO
                wall = run(args.out / f"{mode}_s{seed}", mode, seed, args.steps, args.overrides, checkout)
                print(f"{mode} seed {seed}: {wall:.0f} s wall", flush=True)
    rows = [
        summarize(d)
        for mode in (*MODES, "baseline")
        for d in sorted(args.out.glob(f"{mode}_s*"))
        if (d / "metrics.jsonl").exists()
    ]
    if not rows:
        raise SystemExit(f"no finished runs under {args.out}")
    print(per_run(rows))
    print()
    print(per_mode(rows))
    print()
    print(gaps(rows))


if __name__ == "__main__":
    main()
