"""Off-policy correction on task=reverse: max_staleness x correction x seeds, side by side (issue 35).

    .venv/bin/python scripts/bench/offpolicy_sweep.py --out /tmp/offpolicy                 # the full grid, 4 seeds
    .venv/bin/python scripts/bench/offpolicy_sweep.py --staleness 0 2 --seeds 0 --steps 120 --out /tmp/offpolicy
    .venv/bin/python scripts/bench/offpolicy_sweep.py --out /tmp/offpolicy --table-only     # the table of finished runs

A cell whose run under --out already logged every step is kept, not run again: the same command goes on with the
grid where an earlier invocation (or session) stopped.

Each cell is one job (`python -m fully_async.runner task=reverse`, jsonl logger only) at
async_training.max_staleness in --staleness with one of the corrections:
  none   bypass mode, nothing weighed or rejected (preset bypass_ppo_clip, opted out of the fail-closed rule)
  tis    decoupled PPO with token-level truncated IS at 2 (preset decoupled_token_is, the default)
  geo    decoupled PPO with token TIS and geometric-mean rejection (preset decoupled_geo_rs_token_tis)
  k3     (only with --corrections k3) bypass, PPO clip on pi_behave, sequences whose mean k3 passes 0.01 rejected
         (preset bypass_ppo_clip_k3_rs)
Runs go one at a time, seed by seed, the order of the corrections rotating with the seed so a drift of the
machine's load does not favour one. From each run's metrics.jsonl (background_sync.py's reading): the last-20 mean
reward, training seconds until the 20-step mean reward first reached 0.8, seconds per step; and here the mean
fraction of loss tokens rejected per step and the mean k3 between the trainer's pi_prox and the engine's log-probs
(decoupled runs only), and the trained tokens' staleness, mean and largest: max_staleness is a ceiling, and how
close a run comes to it depends on whether the trainer or the engine is the slower (on 2 cores the trainer of
task=reverse is the faster, so a quiet run at max_staleness=8 trains ~1.5 versions old; a loaded trainer lets the
engine run up to the bound). Prints one row per run and one per (staleness, correction), in Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from background_sync import LEVEL, markdown, run, summarize  # scripts/bench is on sys.path as a script

from fully_async.config.sections import AsyncTrainingConfig

CORRECTIONS = {
    "none": [
        "algorithm.rollout_correction.preset=bypass_ppo_clip",
        "algorithm.rollout_correction.allow_uncorrected=true",
    ],
    "tis": ["algorithm.rollout_correction.preset=decoupled_token_is"],
    "geo": ["algorithm.rollout_correction.preset=decoupled_geo_rs_token_tis"],
    "k3": ["algorithm.rollout_correction.preset=bypass_ppo_clip_k3_rs"],
}
GRID = ["none", "tis", "geo"]
"""The default grid's corrections (k3 on request: `--corrections k3`)."""


def offpolicy(run_dir: Path) -> dict:
    """Mean per step of the rejected token fraction, of the trainer-vs-engine k3 and of the trained tokens' staleness
    (what the bound let happen: the trainer-to-engine speed ratio decides how close to it a run comes), and the
    largest token staleness trained (nan where not logged)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]

    def mean(*keys: str) -> float:
        vals = [next(r[k] for k in keys if k in r) for r in rows if any(k in r for k in keys)]
        return statistics.mean(vals) if vals else float("nan")

    return {
        "rejected": mean("offpolicy/rejected_token_frac", "rollout_corr/rollout_rs_masked_fraction"),
        "k3": mean("offpolicy/k3"),
        "token_staleness": mean("staleness/token_mean"),
        "token_staleness_max": max(
            (r["staleness/token_max"] for r in rows if "staleness/token_max" in r), default=float("nan")
        ),
    }


def finished(run_dir: Path, steps: int) -> bool:
    """The run under `run_dir` logged all its `steps` (an interrupted one is run again from the start)."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= steps


def row(run_dir: Path) -> dict:
    staleness, correction, seed = run_dir.name.split("_")
    return {**summarize(run_dir), **offpolicy(run_dir), "staleness": int(staleness[1:]), "correction": correction,
            "seed": int(seed[4:])}  # fmt: skip


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def tables(rows: list[dict]) -> str:
    per_run = markdown(
        ["run", "steps", "last 20", f"s to {LEVEL}", "s per step", "token staleness: mean (max)", "rejected tokens",
         "k3 prox vs behave"],
        [[r["name"], str(r["steps"]), f"{r['last20']:.3f}", _fmt(r["reached"], ".0f"), f"{r['step_s']:.2f}",
          f"{_fmt(r['token_staleness'], '.2f')} ({_fmt(r['token_staleness_max'], '.0f')})", _fmt(r["rejected"], ".3f"),
          _fmt(r["k3"], ".2e")] for r in rows],
    )  # fmt: skip
    cells = []
    for s in sorted({r["staleness"] for r in rows}):
        for c in CORRECTIONS:
            rs = [r for r in rows if r["staleness"] == s and r["correction"] == c]
            if not rs:
                continue
            hit = [r["reached"] for r in rs if r["reached"] is not None]
            last = [r["last20"] for r in rs]
            rej = [r["rejected"] for r in rs if r["rejected"] == r["rejected"]]
            cells.append([
                str(s), c, str(len(rs)), f"{statistics.mean(last):.3f} ({min(last):.3f}-{max(last):.3f})",
                f"{statistics.median(hit):.0f} ({len(hit)} of {len(rs)})" if hit else f"- (0 of {len(rs)})",
                f"{statistics.mean(r['step_s'] for r in rs):.2f}",
                f"{statistics.mean(r['token_staleness'] for r in rs):.2f} ({max(r['token_staleness_max'] for r in rs):.0f})",
                _fmt(statistics.mean(rej) if rej else None, ".3f"),
            ])  # fmt: skip
    summary = markdown(["max_staleness", "correction", "seeds", "last 20: mean (min-max)",
                        f"s to {LEVEL}: median (runs that reached it)", "s per step", "token staleness: mean (max)",
                        "rejected tokens"], cells)  # fmt: skip
    return per_run + "\n\n" + summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 8])
    parser.add_argument("--corrections", nargs="+", default=GRID, choices=list(CORRECTIONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: task=reverse's)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/offpolicy"))
    parser.add_argument("--table-only", action="store_true", help="summarise the runs already under --out")
    parser.add_argument("overrides", nargs="*", help="further key=value overrides for every run")
    args = parser.parse_args()
    if not args.table_only:
        from fully_async.config import compose

        steps = args.steps or compose(["task=reverse"]).trainer.total_steps
        mode = AsyncTrainingConfig().sync_mode
        for seed in args.seeds:
            order = args.corrections[seed % len(args.corrections) :] + args.corrections[: seed % len(args.corrections)]
            for s in args.staleness:
                for c in order:
                    out = args.out / f"s{s}_{c}_seed{seed}"
                    if finished(out, steps):  # the grid spans sessions: a rerun of the command goes on where it was
                        print(f"max_staleness={s} {c} seed {seed}: finished before, kept", flush=True)
                        continue
                    extra = ["task=reverse", f"async_training.max_staleness={s}", *CORRECTIONS[c], *args.overrides]
                    wall = run(out, mode, seed, steps, extra)
                    print(f"max_staleness={s} {c} seed {seed}: {wall:.0f} s wall", flush=True)
    rows = [row(d) for d in sorted(args.out.glob("s*_*_seed*")) if (d / "metrics.jsonl").exists()]
    if not rows:
        raise SystemExit(f"no finished runs under {args.out}")
    print(tables(rows))


if __name__ == "__main__":
    main()
