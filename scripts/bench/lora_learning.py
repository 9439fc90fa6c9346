"""The default job with LoRA (model.lora.rank=8) against full fine-tuning, side by side per seed (issue 25).

    .venv/bin/python scripts/bench/lora_learning.py --seeds 0 1 2 3 --out /tmp/lora_learning
    .venv/bin/python scripts/bench/lora_learning.py --out /tmp/lora_learning --table-only   # the table of finished runs

For each seed, the default job (`python -m fully_async.runner`, its default steps and sync mode, jsonl logger only)
runs once in full fine-tuning and once with `model.lora.rank=8` plus `--lora` overrides (default: the adapter's
documented learning rate; the adapter sync, model.lora.sync=auto), one after the other, the
order alternating by seed so a drift of the machine's load does not favour one. From each run's metrics.jsonl (the
same reading as background_sync.py): the last-20 mean reward, the training seconds until the 20-step mean reward
first reached 0.8, seconds per step and the trainer's seconds held by weight syncs per step. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from background_sync import LEVEL, markdown, per_run, run, summarize  # scripts/bench is on sys.path as a script

from fully_async.config.sections import AsyncTrainingConfig

KINDS = ("full", "lora")
LORA = ["model.lora.rank=8", "model.lora.lr=3e-3"]


def per_kind(rows: list[dict]) -> str:
    columns = ["training", "runs", "last 20: mean (min-max)", f"s to {LEVEL}: median (runs that reached it)",
               "s per step", "held by sync, s"]  # fmt: skip
    out = []
    for kind in KINDS:
        rs = [r for r in rows if r["name"].startswith(kind)]
        if not rs:
            continue
        hit = [r["reached"] for r in rs if r["reached"] is not None]
        last = [r["last20"] for r in rs]
        out.append([
            kind, str(len(rs)), f"{statistics.mean(last):.3f} ({min(last):.3f}-{max(last):.3f})",
            f"{statistics.median(hit):.0f} ({len(hit)} of {len(rs)})" if hit else f"- (0 of {len(rs)})",
            f"{statistics.mean(r['step_s'] for r in rs):.3f}", f"{statistics.mean(r['sync_s'] for r in rs):.3f}",
        ])  # fmt: skip
    return markdown(columns, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=500, help="trainer.total_steps (the default job's: 500)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/lora_learning"))
    parser.add_argument("--lora", nargs="*", default=LORA, help=f"the LoRA runs' overrides (default: {LORA})")
    parser.add_argument("--table-only", action="store_true", help="summarise the runs already under --out")
    parser.add_argument("overrides", nargs="*", help="further key=value overrides for every run")
    args = parser.parse_args()
    mode = AsyncTrainingConfig().sync_mode  # the default job's
    if not args.table_only:
        for seed in args.seeds:
            for kind in KINDS if seed % 2 == 0 else tuple(reversed(KINDS)):
                extra = [*args.overrides, *(args.lora if kind == "lora" else [])]
                wall = run(args.out / f"{kind}_s{seed}", mode, seed, args.steps, extra)
                print(f"{kind} seed {seed}: {wall:.0f} s wall", flush=True)
    rows = [summarize(d) for k in KINDS for d in sorted(args.out.glob(f"{k}_s*")) if (d / "metrics.jsonl").exists()]
    if not rows:
        raise SystemExit(f"no finished runs under {args.out}")
    print(per_run(rows))
    print()
    print(per_kind(rows))


if __name__ == "__main__":
    main()
