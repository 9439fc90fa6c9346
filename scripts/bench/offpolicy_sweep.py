r"""Off-policy correction on task=reverse: max_staleness x correction x seeds, side by side (issue 35).

    .venv/bin/python scripts/bench/offpolicy_sweep.py --out /tmp/offpolicy                 # the full grid, 4 seeds
    .venv/bin/python scripts/bench/offpolicy_sweep.py --staleness 0 2 --seeds 0 --steps 120 --out /tmp/offpolicy
    .venv/bin/python scripts/bench/offpolicy_sweep.py --out /tmp/offpolicy --table-only     # the full grid's tables
    .venv/bin/python scripts/bench/offpolicy_sweep.py --out /tmp/offpolicy --staleness 2 8 --corrections geo -- \
        "algorithm.rollout_correction.rollout_rs_threshold='0.9_1.1'"                    # runs of its own: widened

Each run is keyed by its whole override set (the correction's preset, max_staleness, seed, steps, sync mode and every
further override): its directory under --out is `s{staleness}_{correction}_seed{seed}_{key}`, `key` a hash of the
sorted overrides, which its `sweep.json` lists. A run of this command that already logged every step is kept, not
run again (the same command goes on with the grid where an earlier invocation, or session, stopped); a command with
other overrides (say, widened rejection bounds) runs its own. The tables hold exactly this command's runs: the same
command with --table-only prints them again.

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
import dataclasses
import hashlib
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


STAMP = "sweep.json"
"""A run directory's record of what it ran: its cell and its whole override set."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the sweep. `extra`: the command's further overrides, for every run."""

    staleness: int
    correction: str
    seed: int
    steps: int
    mode: str
    extra: tuple[str, ...] = ()

    def job_overrides(self) -> list[str]:
        """The overrides background_sync.run adds to the seed, sync mode and steps it sets itself."""
        return ["task=reverse", f"async_training.max_staleness={self.staleness}", *CORRECTIONS[self.correction],
                *self.extra]  # fmt: skip

    def overrides(self) -> list[str]:
        """Every override the run's job gets (all but its run directory and the logger), sorted: what keys it."""
        return sorted([f"seed={self.seed}", f"async_training.sync_mode={self.mode}",
                       f"trainer.total_steps={self.steps}", *self.job_overrides()])  # fmt: skip

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.overrides()).encode()).hexdigest()[:10]

    def run_dir(self, out: Path) -> Path:
        return out / f"s{self.staleness}_{self.correction}_seed{self.seed}_{self.key()}"


def cells(staleness: list[int], corrections: list[str], seeds: list[int], steps: int, mode: str,
          extra: list[str]) -> list[Cell]:  # fmt: skip
    """The command's runs in the order they run: seed by seed, the order of the corrections rotating with the seed."""
    out = []
    for seed in seeds:
        order = corrections[seed % len(corrections) :] + corrections[: seed % len(corrections)]
        out += [Cell(s, c, seed, steps, mode, tuple(extra)) for s in staleness for c in order]
    return out


def stamp(cell: Cell, out: Path) -> None:
    """Write the run directory's STAMP (before the run: an interrupted run's directory says what it was)."""
    run_dir = cell.run_dir(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"staleness": cell.staleness, "correction": cell.correction, "seed": cell.seed,
              "overrides": cell.overrides()}  # fmt: skip
    (run_dir / STAMP).write_text(json.dumps(record, indent=1) + "\n")


def finished(cell: Cell, out: Path) -> bool:
    """The run of `cell` under `out` ran with exactly its overrides (its STAMP) and logged all its steps (an
    interrupted one is run again from the start)."""
    run_dir = cell.run_dir(out)
    metrics, record = run_dir / "metrics.jsonl", run_dir / STAMP
    if not (metrics.is_file() and record.is_file()):
        return False
    if json.loads(record.read_text()).get("overrides") != cell.overrides():
        return False
    return sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= cell.steps


def finished_runs(grid: list[Cell], out: Path) -> list[Path]:
    """The directories of the command's finished runs (its tables' rows), none of another command's."""
    return [cell.run_dir(out) for cell in grid if finished(cell, out)]


def recorded(run_dir: Path) -> dict:
    """The cell a run directory's STAMP records: staleness, correction, seed."""
    record = json.loads((run_dir / STAMP).read_text())
    return {k: record[k] for k in ("staleness", "correction", "seed")}


def row(run_dir: Path) -> dict:
    return {**summarize(run_dir), **offpolicy(run_dir), **recorded(run_dir)}


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
    from fully_async.config import compose

    steps = args.steps or compose(["task=reverse"]).trainer.total_steps
    grid = cells(args.staleness, args.corrections, args.seeds, steps, AsyncTrainingConfig().sync_mode, args.overrides)
    for cell in [] if args.table_only else grid:
        what = f"max_staleness={cell.staleness} {cell.correction} seed {cell.seed}"
        if finished(cell, args.out):  # the grid spans sessions: a rerun of the command goes on where it was
            print(f"{what}: finished before, kept ({cell.run_dir(args.out).name})", flush=True)
            continue
        stamp(cell, args.out)
        wall = run(cell.run_dir(args.out), cell.mode, cell.seed, cell.steps, cell.job_overrides())
        print(f"{what}: {wall:.0f} s wall", flush=True)
    rows = [row(run_dir) for run_dir in finished_runs(grid, args.out)]
    if not rows:
        raise SystemExit(f"no finished runs of this command under {args.out}")
    if args.overrides:
        print("every run also with: " + " ".join(args.overrides))
    print(tables(sorted(rows, key=lambda r: r["name"])))


if __name__ == "__main__":
    main()
