"""On-policy distillation benchmarks (issue 50, docs/distillation.md).

    .venv/bin/python scripts/bench/distill.py --only latency      # a slow teacher hidden behind generation (minutes)
    .venv/bin/python scripts/bench/distill.py --only sync --out /tmp/dsync   # async against sync (~9 min a pair; --seed N)

- latency: the reward-delay benchmark's method (scripts/bench/reward.py --only sim-delay) with the teacher in the
  reward's place: two runs of scripts/bench/pipeline.py (the whole pipeline in simulation: real Rollouter,
  MessageQueue, ledger, ParamSync and trainer loop; emulated engines and trainer on the calibrated 128-GPU profile,
  fully async eta = 1 with partial rollout), each with distillation on and a teacher at a url
  (tests/teacher_server.py on 127.0.0.1, its own process), once answering at once and once after uniform[1, 40]
  simulated seconds per sample; prints both throughputs and their ratio after the first version (goal >= 0.95).
- sync: fully async against synchronous distillation, same seed, on the tiny model: a teacher trained by the default
  job (the copy task, --teacher-steps steps; or --teacher DIR, a Hugging Face export) teaches a fresh tiny student
  (the same byte-level tokenizer) by pure distillation (distill.coef=1, the teacher on a vLLM-CPU server of its own);
  once fully async (background sync; max_staleness 1, the job's default, or --max-staleness) and once synchronous
  (max_staleness 0, blocking sync: each step's batch generated, rewarded and teacher-scored by the weights just
  trained, the trainer waiting for it), alternating with --pairs; --baseline group sets distill.baseline in both.
  Prints each run's training seconds to the common reward level (the lower last-20 mean of the two, less 0.02, as
  scripts/bench/e2e_runs.py --pair) and the async / sync ratio (goal <= 0.6), then the training seconds to each
  reward level on the seed-averaged curves. KEY=VALUE arguments go to every run (a GPU machine's device and
  placement).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def teacher(port: int, delay: str, time_scale: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.teacher_server", str(port), "--delay", delay, "--time-scale", str(time_scale)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the teacher server did not start")
    return proc


def latency(versions: int, time_scale: float) -> None:
    from fully_async.engines.process import free_port

    spec = importlib.util.spec_from_file_location("fully_async_bench_pipeline", HERE / "pipeline.py")
    pipeline = importlib.util.module_from_spec(spec)  # the sibling script, by path (scripts/ is no package)
    spec.loader.exec_module(pipeline)
    out = Path(tempfile.mkdtemp(prefix="fully_async-distill-latency-"))
    rates = {}
    for name, delay in (("no latency", "0,0"), ("uniform[1, 40] s", "1,40")):
        port = free_port()
        server = teacher(port, delay, time_scale)
        try:
            run_dir = out / ("slow" if delay != "0,0" else "fast")
            distill = ["distill.enable=true", f"distill.teacher.url=http://127.0.0.1:{port}/v1",
                       "distill.teacher.model=teacher", "distill.timeout_s=120"]  # fmt: skip
            cmd = [sys.executable, str(HERE / "pipeline.py"), "--versions", str(versions), "--time-scale",
                   str(time_scale), "--schedules", "async_eta1_partial", "--out", str(run_dir), *distill]  # fmt: skip
            print(f"latency: {name}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        finally:
            server.kill()
            server.wait()
        summary = json.loads((run_dir / "async_eta1_partial" / "bench.json").read_text())
        s = pipeline.evaluate(run_dir / "async_eta1_partial")
        metrics = [json.loads(x) for x in (run_dir / "async_eta1_partial" / "metrics.jsonl").read_text().splitlines()]
        calls = sum(m.get("fully_async/reward/teacher/calls", 0.0) for m in metrics)
        gen = [m["timing_s/agent_loop/generate/mean"] for m in metrics if "timing_s/agent_loop/generate/mean" in m]
        rates[name] = (s["samples_per_s"], s["samples_per_s_steady"])
        print(f"latency: {name}: {s['samples']} samples, {s['samples_per_s']:.1f} samples/s (simulated), trainer idle "
              f"{s['trainer_idle']:.2f}, rollouter idle {s['rollouter_idle']:.2f}, {calls:.0f} teacher calls, "
              f"{s['cpu_ms_per_sample']:.2f} CPU ms a sample, generation {sum(gen) / max(len(gen), 1):.3f} s a sample "
              f"(the steps' means), {summary['wall_s']:.0f} wall s", flush=True)  # fmt: skip
    (none, none_steady), (slow, slow_steady) = rates["no latency"], rates["uniform[1, 40] s"]
    print(f"\n| teacher latency | samples/s, whole run | samples/s after the first version |\n|---|---|---|\n"
          f"| none | {none:.1f} | {none_steady:.1f} |\n| uniform[1, 40] s | {slow:.1f} | {slow_steady:.1f} |\n"
          f"\nthroughput ratio (slow / none): {slow / none:.3f} whole run, {slow_steady / none_steady:.3f} after the "
          "first version")  # fmt: skip


SYNC = ["async_training.max_staleness=0", "async_training.sync_mode=blocking"]
"""Synchronous distillation, as --only sync runs it (the rest of the job is the default's): each step's batch
generated, rewarded and teacher-scored by the weights just trained, the trainer waiting for it."""


def sync_modes(max_staleness: int, baseline: str) -> dict[str, list[str]]:
    """The two ways to distill compared by --only sync, by run-directory name: fully async at `max_staleness` (the
    job's default, 1, keeps its plain name) with background sync, and synchronous; both with distill.baseline
    `baseline` (named when not "none")."""
    name = "async" if max_staleness == 1 else f"async_s{max_staleness}"
    tag = "" if baseline == "none" else f"_{baseline}"
    base = [f"distill.baseline={baseline}"]
    return {name + tag: [f"async_training.max_staleness={max_staleness}", *base], "sync" + tag: [*SYNC, *base]}


def runner(out: Path, overrides: list[str]) -> float:
    """One job of the runner into `out`; its wall seconds. Its console output goes to out/stdout.log."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fully_async.runner", f"hydra.run.dir={out}", "logger.backends=[jsonl]", *overrides]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    start = time.monotonic()
    with open(out / "stdout.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{out}: the run failed (exit {rc}); see {out / 'stdout.log'}")
    return time.monotonic() - start


def seed_averaged(runs: dict[str, list[dict]], mean_at) -> None:
    """Training seconds to each reward level on the seed-averaged curves of the two ways (the 20-step mean of each
    run at a time, averaged over seeds; times every 5 s up to the shortest run's end): one comparison over all seeds,
    less at the mercy of one run's noise than the per-seed ratios."""
    end = min(r["elapsed"][-1] for rs in runs.values() for r in rs)
    grid = [t * 5.0 for t in range(1, int(end // 5) + 1)]
    curves = {}
    for name, rs in runs.items():
        points = [[mean_at(r, t) for r in rs] for t in grid]
        curves[name] = [sum(p) / len(p) if None not in p else None for p in points]
    (fast, a), (slow, s_) = curves.items()
    print(f"\nseed-averaged curves ({len(runs[fast])} seeds, training s up to {end:.0f}):\n"
          f"| mean reward | {fast} s | {slow} s | ratio |\n|---|---|---|---|")  # fmt: skip
    for tenth in range(1, 10):
        level = tenth / 10
        ta = next((t for t, m in zip(grid, a) if m is not None and m >= level), None)
        ts = next((t for t, m in zip(grid, s_) if m is not None and m >= level), None)
        if ta is not None and ts is not None:
            print(f"| {level:.1f} | {ta:.0f} | {ts:.0f} | {ta / ts:.2f} |")


def sync_vs_async(out: Path, teacher_dir: Path | None, teacher_steps: int, steps: int, pairs: int, seed0: int,
                  max_staleness: int, baseline: str, extra: list[str]) -> None:  # fmt: skip
    sys.path.insert(0, str(HERE))
    from e2e_runs import load, mean_at  # the sibling script's learning-curve readers

    if teacher_dir is None:
        run = out / "teacher"
        teacher_dir = run / "checkpoints" / f"step_{teacher_steps}" / "hf"
        if not (teacher_dir / "config.json").exists():
            wall = runner(run, [f"trainer.total_steps={teacher_steps}", *extra])
            print(f"sync: teacher trained in {wall:.0f} s, last-20 reward {load(run)['last20']:.3f}", flush=True)
    distill = ["distill.enable=true", f"distill.teacher.path={teacher_dir}", "distill.coef=1.0",
               "algorithm.filter_groups.enable=false", f"trainer.total_steps={steps}", "trainer.save_hf=false",
               *extra]  # fmt: skip
    modes = sync_modes(max_staleness, baseline)
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for pair in range(pairs):
        order = list(modes) if pair % 2 == 0 else list(reversed(modes))
        for name in order:
            run = out / f"{name}_{seed0 + pair}"
            if not (run / "metrics.jsonl").exists():
                wall = runner(run, [*distill, f"seed={seed0 + pair}", *modes[name]])
                print(f"sync: {name} pair {pair}: {wall:.0f} s wall", flush=True)
            runs[name].append(load(run))
    print(
        "\n| seed | run | s per step | last 20 | common level | training s to it | async / sync |\n|---|---|---|---|---|---|---|"
    )
    fast, slow = modes
    for pair in range(pairs):
        a, s_ = runs[fast][pair], runs[slow][pair]
        level = min(a["last20"], s_["last20"]) - 0.02
        to = {}
        for name, r in ((fast, a), (slow, s_)):
            hit = next(i for i, m in enumerate(r["means"]) if m >= level)  # reached: the last mean is above it
            to[name] = r["elapsed"][hit + 19]
        ratio = to[fast] / to[slow]
        for name, r in ((fast, a), (slow, s_)):
            print(f"| {seed0 + pair} | {name} | {r['step_s']:.3f} | {r['last20']:.3f} | {level:.3f} | {to[name]:.1f} | "
                  f"{ratio:.2f} |")  # fmt: skip
    seed_averaged(runs, mean_at)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="latency", choices=["latency", "sync"])
    ap.add_argument("--versions", type=int, default=3, help="latency: weight versions per run")
    ap.add_argument("--time-scale", type=float, default=2.0,
                    help="latency: simulated seconds per wall second (at 5 the teacher stub and its HTTP calls, on the "
                    "same 2 cores, could not keep up even with no latency: they, not the latency, bound the run)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="sync: the runs' directory (finished runs are reused)")
    ap.add_argument("--teacher", type=Path, default=None, help="sync: a teacher's HF export (default: train one)")
    ap.add_argument("--teacher-steps", type=int, default=300, help="sync: steps of the teacher's default job")
    ap.add_argument("--steps", type=int, default=150, help="sync: steps of each student run")
    ap.add_argument("--pairs", type=int, default=1, help="sync: async/sync pairs (seeds 0, 1, ...; order alternates)")
    ap.add_argument("--seed", type=int, default=0, help="sync: the first pair's seed (the next pairs count on)")
    ap.add_argument("--max-staleness", type=int, default=1,
                    help="sync: the fully async run's async_training.max_staleness (1: the job's default)")  # fmt: skip
    ap.add_argument("--baseline", default="none", choices=["none", "group"], help="sync: distill.baseline of both runs")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="sync: more overrides for every run, the teacher's too (a GPU machine: trainer.device=cuda, "
                    "the engine's and placement's keys as docs/cluster.md)")  # fmt: skip
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    if args.only == "latency":
        latency(args.versions, args.time_scale)
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="fully_async-distill-sync-"))
        sync_vs_async(
            out,
            args.teacher,
            args.teacher_steps,
            args.steps,
            args.pairs,
            args.seed,
            args.max_staleness,
            args.baseline,
            args.overrides,
        )


if __name__ == "__main__":
    main()
