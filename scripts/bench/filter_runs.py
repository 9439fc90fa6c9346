"""Dynamic sampling on vs off, and PPO with a critic vs GRPO (docs/benchmarks.md, issue 19): one row per finished run
directory, then one line per variant (runs grouped by their name without the trailing `_s<seed>`).

    .venv/bin/python scripts/bench/filter_runs.py /tmp/b19/*_s?

Per run, from metrics.jsonl and trajectories.jsonl (which logs filtered groups too, with `filtered: true`):
- seconds: training-loop seconds (sum of `timing_s/step`; start-up is not in them);
- first / last reward: the mean reward of every sample generated (trained or filtered) in the first / last 20 steps
  (the trained batches alone are biased once groups are filtered, since constant groups are left out);
- reward/s: (last - first) / seconds, the reward gained per training second;
- filtered: filtered groups / all groups the run finished (trained + filtered).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load(run: Path) -> dict:
    metrics = read_jsonl(run / "metrics.jsonl")
    trajs = read_jsonl(run / "trajectories.jsonl")
    steps = len(metrics)
    seconds = sum(m["timing_s/step"] for m in metrics)
    window = min(20, steps)

    def reward(lo: int, hi: int) -> float:
        rs = [t["reward"] for t in trajs if lo <= t["step"] <= hi]
        return statistics.mean(rs) if rs else float("nan")

    first, last = reward(1, window), reward(steps - window + 1, steps)
    groups = {(t["prompt_uid"], bool(t.get("filtered"))) for t in trajs}
    filtered = sum(f for _, f in groups)
    return {
        "name": run.name,
        "variant": re.sub(r"_s\d+$", "", run.name),
        "steps": steps,
        "seconds": seconds,
        "first": first,
        "last": last,
        "rate": (last - first) / seconds,
        "filtered": filtered / max(1, len(groups)),
        "vf_ev": metrics[-1].get("critic/vf_explained_var"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    runs = [load(r) for r in ap.parse_args().runs]
    print("| run | steps | training s | first 20 | last 20 | reward/s | filtered groups | critic explained var |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        ev = "" if r["vf_ev"] is None else f"{r['vf_ev']:.2f}"
        print(f"| {r['name']} | {r['steps']} | {r['seconds']:.0f} | {r['first']:.3f} | {r['last']:.3f} | "
              f"{r['rate']:.4f} | {r['filtered']:.2f} | {ev} |")  # fmt: skip
    by: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by[r["variant"]].append(r)
    print()
    print("| variant | seeds | median training s | last 20 (mean +- sd) | reward/s (median) | filtered groups (mean) |")
    print("|---|---|---|---|---|---|")
    for v, rs in by.items():
        sd = statistics.stdev([r["last"] for r in rs]) if len(rs) > 1 else 0.0
        print(f"| {v} | {len(rs)} | {statistics.median(r['seconds'] for r in rs):.0f} | "
              f"{statistics.mean(r['last'] for r in rs):.3f} +- {sd:.3f} | "
              f"{statistics.median(r['rate'] for r in rs):.4f} | "
              f"{statistics.mean(r['filtered'] for r in rs):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
