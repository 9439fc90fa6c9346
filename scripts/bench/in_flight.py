"""What a weight sync does to the requests in flight (issue 52): async_training.on_sync = abort, recompute, keep,
one run per mode, side by side.

    .venv/bin/python scripts/bench/in_flight.py perf --out /tmp/in_flight    # SmolLM2-135M, task=arith, 4 steps a mode
    .venv/bin/python scripts/bench/in_flight.py tiny --out /tmp/in_flight    # the tiny model, 128-token responses
    .venv/bin/python scripts/bench/in_flight.py learn --out /tmp/in_flight   # tiny model, max_staleness 2, 2 seeds
    .venv/bin/python scripts/bench/in_flight.py perf --out /tmp/in_flight --table-only

perf: `python -m fully_async.runner task=arith` (SmolLM2-135M-Instruct on vLLM-CPU, verl on the other core; a sync
every step, max_staleness 1, background sync) with no validation, made engine-bound (every sample its whole 128-token
budget, no dynamic sampling: see PARTS), `--steps` steps per mode, the modes one after the other (two runs at once
would share the same two cores). tiny: the same on the default job (the tiny model, the copy task), 128-token
responses. Per mode, from metrics.jsonl (steps after the first, whose
window holds the engines' first batch): requests aborted / frozen per sync, tokens prefilled again per sync by the
client (abort) and inside the engine (recompute), the engines' generated tokens per second of wall time and per second
busy, the step period, the sync's pause phase (stop admission, pause the engines), and k3 by the tokens' staleness and
by their KV cache's.

learn: the default job (the tiny model from random init, the copy task) with 128-token responses, so requests are in
flight at every sync, at max_staleness 2, `--steps` steps, seeds 0 and 1 per mode: the last-20 mean reward, the mean
per-step k3 by staleness and by cache staleness, and the same in-flight counters.

Runs are kept under --out/<part>/<mode>[_seed<s>]; one already finished (its metrics.jsonl has every step) is not run
again. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("abort", "recompute", "keep")
PARTS = {
    # SmolLM2 made engine-bound: every sample runs its whole 128-token budget (ignore_eos) and every group is trained
    # (no dynamic sampling), so the engines still generate when the sync comes. As shipped, task=arith is
    # trainer-bound here (the update ~48 s, the engines idle ~40 %) and its syncs met no request in flight.
    "perf": {"steps": 4, "seeds": [0], "overrides": [
        "task=arith", "trainer.val_every=0", "trainer.val_before_train=false", "rollout.ignore_eos=true",
        "rollout.response_length=128", "algorithm.filter_groups.enable=false"]},
    "tiny": {"steps": 40, "seeds": [0], "overrides": ["rollout.response_length=128"]},
    # The default job as shipped (one-token answers: with 128-token responses the tiny model learned nothing in 100
    # steps in any mode, last-20 reward 0.003-0.006, its gradient spread over ~80 tokens). The engines are busy all the
    # time, so a sync still meets requests in flight: waiting for or in their prefill.
    "learn": {"steps": 100, "seeds": [0, 1], "overrides": ["async_training.max_staleness=2"]},
}  # fmt: skip
COUNTERS = ("aborted_requests", "frozen_requests", "client_reprefill_tokens", "engine_reprefill_tokens")


def run(run_dir: Path, overrides: list[str], steps: int) -> None:
    """One run into `run_dir` unless a finished one is there; console to stdout.log."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
        print(f"[in_flight] {run_dir.name}: done before, kept", flush=True)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # a loopback Ray for a benchmark on this machine only
    cmd = [sys.executable, "-m", "fully_async.runner", f"hydra.run.dir={run_dir}", f"trainer.total_steps={steps}",
           *overrides]  # fmt: skip
    print(f"[in_flight] {run_dir.name}: {' '.join(cmd[3:])}", flush=True)
    start = time.monotonic()
    with open(run_dir / "stdout.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    print(f"[in_flight] {run_dir.name}: {time.monotonic() - start:.0f} s", flush=True)


def _mean(rows: list[dict], key: str) -> float | None:
    values = [m[key] for m in rows if key in m]
    return statistics.mean(values) if values else None


def _k3(rows: list[dict], prefix: str) -> str:
    """Mean per-step k3 per staleness bucket that occurs, e.g. '0: 3.1e-11, 1: 7.7e-4'."""
    buckets = sorted({k[len(prefix) :].split("/")[0] for m in rows for k in m if k.startswith(prefix)})
    return ", ".join(f"{b}: {_mean(rows, f'{prefix}{b}/k3'):.1e}" for b in buckets) or "-"


def summarize(run_dir: Path) -> dict:
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rest = metrics[1:] or metrics
    busy = [1.0 - m["fully_async/rollouter/idle_ratio"] for m in rest]
    gen = [m["perf/generated_tokens_per_s"] for m in rest]
    out = {
        "name": run_dir.name,
        "steps": len(metrics),
        "step_s": statistics.median(m["timing_s/step"] for m in rest),
        "gen_tok_s": statistics.mean(gen),
        "busy_tok_s": sum(g * m["timing_s/step"] for g, m in zip(gen, rest))
        / max(1e-9, sum(b * m["timing_s/step"] for b, m in zip(busy, rest))),
        "pause_s": _mean(rest, "timing_s/param_sync/pause") or 0.0,
        "reward_last20": statistics.mean(m["reward/mean"] for m in metrics[-20:]),
        "k3": _k3(rest, "offpolicy/staleness_"),
        "cache_k3": _k3(rest, "offpolicy/cache_staleness_"),
        "cache_older": _mean(rest, "offpolicy/cache_older_tokens"),
    }
    for c in COUNTERS:
        out[c] = _mean(rest, f"fully_async/in_flight/{c}") or 0.0
    return out


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] +
                     ["| " + " | ".join(r) + " |" for r in rows])  # fmt: skip


def perf_table(rows: list[dict]) -> str:
    columns = ["on_sync", "steps", "aborted / frozen per sync", "re-prefilled tokens per sync: client / engine",
               "generated tok/s (wall)", "tok/s per engine-busy s", "step s (median)", "pause s",
               "k3 by staleness", "k3 by cache staleness"]  # fmt: skip
    return markdown(columns, [[r["name"], str(r["steps"]), f"{r['aborted_requests']:.1f} / {r['frozen_requests']:.1f}",
                               f"{r['client_reprefill_tokens']:.0f} / {r['engine_reprefill_tokens']:.0f}",
                               f"{r['gen_tok_s']:.1f}", f"{r['busy_tok_s']:.1f}", f"{r['step_s']:.1f}",
                               f"{r['pause_s']:.3f}", r["k3"], r["cache_k3"]] for r in rows])  # fmt: skip


def learn_table(rows: list[dict]) -> str:
    by_mode: dict[str, list[dict]] = {}
    for r in rows:
        by_mode.setdefault(r["name"].split("_seed")[0], []).append(r)
    columns = ["on_sync", "seeds", "last-20 reward, per seed", "mean", "re-prefilled per sync: client / engine",
               "frozen per sync", "k3 by staleness (seed 0)", "k3 by cache staleness (seed 0)"]  # fmt: skip
    out = []
    for mode, rs in by_mode.items():
        out.append([mode, str(len(rs)), " / ".join(f"{r['reward_last20']:.3f}" for r in rs),
                    f"{statistics.mean(r['reward_last20'] for r in rs):.3f}",
                    f"{statistics.mean(r['client_reprefill_tokens'] for r in rs):.0f} / "
                    f"{statistics.mean(r['engine_reprefill_tokens'] for r in rs):.0f}",
                    f"{statistics.mean(r['frozen_requests'] for r in rs):.1f}", rs[0]["k3"], rs[0]["cache_k3"]])  # fmt: skip
    return markdown(columns, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=list(PARTS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/in_flight"))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--table-only", action="store_true", help="summarise the runs already under --out")
    parser.add_argument("overrides", nargs="*", help="further key=value overrides for every run")
    args = parser.parse_args()
    part = PARTS[args.part]
    steps, seeds = args.steps or part["steps"], args.seeds or part["seeds"]
    dirs = []
    for seed in seeds:
        for mode in args.modes:
            name = f"{mode}_seed{seed}" if args.part == "learn" else mode
            run_dir = args.out / args.part / name
            dirs.append(run_dir)
            if not args.table_only:
                run(run_dir, [*part["overrides"], f"async_training.on_sync={mode}", f"seed={seed}", *args.overrides],
                    steps)  # fmt: skip
    done = [
        d for d in dirs if (d / "metrics.jsonl").exists() and len((d / "metrics.jsonl").read_text().splitlines()) > 1
    ]
    rows = [summarize(d) for d in done]
    print(learn_table(rows) if args.part == "learn" else perf_table(rows))


if __name__ == "__main__":
    main()
