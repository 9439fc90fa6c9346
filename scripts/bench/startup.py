"""Start-up of the default job: this tree against another (the commit before the overlap) side by side (issue 39).

    .venv/bin/python scripts/bench/startup.py --base /tmp/base --runs 3 --out /tmp/startup
    .venv/bin/python scripts/bench/startup.py --base /tmp/base --out /tmp/startup --table-only

`--base`: a clone of the other commit with its own `.venv` (an editable install of that clone: this tree's venv
copied, its `__editable__` files pointed at the clone) and the same `.venv-engine`. Each round runs the default
command (`python -m fully_async.runner`, jsonl logger only) once in each tree, the order alternating by round so a
drift of the machine's load favours neither; the load average is read before each run. From each run: the command's
wall seconds; seconds from the command to the first step's end (metrics.jsonl's first `timestamp`); the first
batch's median `generate_s` over a steady batch's (the median of the steps after the fifth) from
trajectories.jsonl; and, where the run records them (this tree), the start-up's parts (`timing_s/startup/*`) and the
shutdown's (RUN_DIR/startup.json). Prints Markdown tables. Every cache (the tiny model, vLLM's) is warm after the
first run of a tree; `--fresh` removes the tiny model's cache before every run (a fresh clone's first command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_CACHE = Path("~/.cache/fully_async/models").expanduser()


def run(tree: Path, out: Path, steps: int, extra: list[str]) -> dict:
    """One default job in `tree`; its wall seconds, load average before it, and the command's start."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(tree / ".venv" / "bin" / "python"), "-m", "fully_async.runner", f"hydra.run.dir={out}",
           f"trainer.total_steps={steps}", "logger=[jsonl]", *extra]  # fmt: skip
    load = os.getloadavg()[0]
    start = time.time()
    with (out / "stdout.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONPATH": ""})
    record = {"wall_s": time.time() - start, "start": start, "load": load, "rc": rc.returncode}
    (out / "bench.json").write_text(json.dumps(record))
    return record


LAUNCH = re.compile(r"^=== (\d{4})-(\d\d-\d\d \d\d:\d\d:\d\d) launching")
VLLM_PHASES = [
    ("api_import", re.compile(r"^\(APIServer pid=")),
    ("engine_core", re.compile(r"^\(EngineCore\w* pid=")),
    ("worker", re.compile(r"^\((VllmWorker|Worker)[^ ]* pid=")),
    ("model_kv", re.compile(r"init engine \(profile, create kv cache")),
    ("http_up", re.compile(r"Starting vLLM server")),
]
STAMP = re.compile(r" (\d\d-\d\d \d\d:\d\d:\d\d) \[")


def engine_phases(log: Path, command_start: float) -> dict[str, float]:
    """The first vLLM server's launch from its log (whole seconds: vLLM stamps its lines to the second): `launch_at`
    (the command to the launch), then each phase's end from the launch (`api_import`: the API server's interpreter
    with torch and vLLM; `engine_core`: the spawned EngineCore process's; `worker`: a worker process's, where one is
    spawned; `model_kv`: the model loaded and the KV cache made; `http_up`: the server listening)."""
    if not log.is_file():
        return {}
    phases: dict[str, float] = {}
    year = launched = None
    for line in log.read_text(errors="replace").splitlines():
        if (m := LAUNCH.match(line)) is not None:
            if launched is not None:
                break  # a restart: only the first launch is the start-up's
            year = m.group(1)
            launched = datetime.datetime.strptime(f"{year}-{m.group(2)}", "%Y-%m-%d %H:%M:%S")
            phases["launch_at"] = launched.timestamp() - command_start
            continue
        if launched is None or (stamp := STAMP.search(line)) is None:
            continue
        for name, pattern in VLLM_PHASES:
            if name not in phases and pattern.search(line):
                at = datetime.datetime.strptime(f"{year}-{stamp.group(1)}", "%Y-%m-%d %H:%M:%S")
                phases[name] = (at - launched).total_seconds()
    return phases


def read(out: Path) -> dict | None:
    """The numbers of one finished run (None when it did not finish)."""
    bench = out / "bench.json"
    if not bench.is_file():
        return None
    record = json.loads(bench.read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if (
        out / "metrics.jsonl").is_file() else []  # fmt: skip
    if record["rc"] != 0 or not rows:
        return record | {"failed": True}
    by_step: dict[int, list[float]] = {}
    for line in (out / "trajectories.jsonl").read_text().splitlines():
        t = json.loads(line)
        by_step.setdefault(int(t["step"]), []).append(float(t["generate_s"]))
    steady = [statistics.median(v) for s, v in by_step.items() if s > 5]
    first = statistics.median(by_step[min(by_step)])
    record |= {
        "first_step_s": rows[0]["timestamp"] - record["start"],
        "first_gen_s": first,
        "steady_gen_s": statistics.median(steady) if steady else float("nan"),
        "startup": {k.split("/", 2)[2]: v for k, v in rows[0].items() if k.startswith("timing_s/startup/")},
        "engine": engine_phases(out / "engines" / "vllm-0.log", record["start"]),
    }
    if (out / "startup.json").is_file():
        shutdown = json.loads((out / "startup.json").read_text()).get("shutdown", {})
        record["shutdown"] = {k.split("/", 2)[2]: v for k, v in shutdown.get("metrics", {}).items()}
    return record


def cell(runs: list[dict], key: str, digits: int = 1) -> str:
    """The median of `key` over `runs`, then every run's value."""
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| tree | runs | load (1 min) | first step (s) | whole command (s) | first batch generate / steady |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for tree, rs in results.items():
        ok = [r for r in rs if not r.get("failed")]
        if not ok:
            lines.append(f"| {tree} | 0 of {len(rs)} finished | | | | |")
            continue
        ratio = [r["first_gen_s"] / r["steady_gen_s"] for r in ok]
        lines.append(f"| {tree} | {len(ok)} | {cell(ok, 'load', 2)} | {cell(ok, 'first_step_s')} | {cell(ok, 'wall_s')} | "
                     f"{statistics.median(ratio):.1f}x ({', '.join(f'{x:.1f}' for x in ratio)}) |")  # fmt: skip
    engine = {tree: [r["engine"] for r in rs if r.get("engine")] for tree, rs in results.items()}
    if any(engine.values()):
        names = ["launch_at"] + [n for n, _ in VLLM_PHASES]
        lines += ["", "| vLLM server's launch (median s; launch_at from the command, the rest from the launch) | "
                  + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
        for tree, es in engine.items():
            if es:
                med = [statistics.median(e.get(n, float("nan")) for e in es) for n in names]
                lines.append(f"| {tree} | " + " | ".join("-" if v != v else f"{v:.0f}" for v in med) + " |")
    parts = [r for r in results.get("this", []) if r.get("startup")]
    if parts:
        names = list(parts[-1]["startup"])
        lines += ["", "| part (this tree, median s) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        med = [statistics.median(r["startup"].get(n, float("nan")) for r in parts) for n in names]
        lines.append("| start-up | " + " | ".join(f"{v:.1f}" for v in med) + " |")
        downs = [r["shutdown"] for r in parts if r.get("shutdown")]
        if downs:
            names = list(downs[-1])
            lines += ["", "| part (this tree, median s) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
            lines.append("| shutdown | " + " | ".join(f"{statistics.median(d.get(n, 0.0) for d in downs):.1f}"
                                                       for n in names) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="clone of the other commit, with its own .venv")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="trainer.total_steps of each run (the default job's)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/startup_bench"))
    parser.add_argument("--fresh", action="store_true", help="remove the tiny model's cache before every run")
    parser.add_argument("--fresh-runs", type=int, default=0,
                        help="after the --runs rounds, this many more per tree with the tiny model's cache removed "
                             "before each (a fresh clone's first command), in their own tables")  # fmt: skip
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "this": REPO}
    sets = [("", args.runs, args.fresh), ("fresh-", args.fresh_runs, True)]
    if not args.table_only:
        for prefix, runs, fresh in sets:
            for k in range(runs):
                order = ["base", "this"] if k % 2 == 0 else ["this", "base"]
                for name in order:
                    if fresh:
                        shutil.rmtree(TINY_CACHE, ignore_errors=True)
                    r = run(trees[name], args.out / f"{prefix}{name}-{k}", args.steps, args.extra)
                    print(
                        f"{prefix}{name} run {k}: rc {r['rc']}, {r['wall_s']:.1f} s, load {r['load']:.2f}", flush=True
                    )
    for prefix, runs, fresh in sets:
        if runs:
            results = {name: [r for k in range(runs) if (r := read(args.out / f"{prefix}{name}-{k}")) is not None]
                       for name in trees}  # fmt: skip
            print(f"\n{'fresh' if fresh else 'warm'} (the tiny model's cache {'removed' if fresh else 'kept'})\n")
            print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
