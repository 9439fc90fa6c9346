"""On-policy distillation benchmarks (issue 50, docs/distillation.md).

    .venv/bin/python scripts/bench/distill.py --only latency      # a slow teacher hidden behind generation (minutes)

- latency: the reward-delay benchmark's method (scripts/bench/reward.py --only sim-delay) with the teacher in the
  reward's place: two runs of scripts/bench/pipeline.py (the whole pipeline in simulation: real Rollouter,
  MessageQueue, ledger, ParamSync and trainer loop; emulated engines and trainer on the calibrated 128-GPU profile,
  fully async eta = 1 with partial rollout), each with distillation on and a teacher at a url
  (tests/teacher_server.py on 127.0.0.1, its own process), once answering at once and once after uniform[1, 40]
  simulated seconds per sample; prints both throughputs and their ratio after the first version (goal >= 0.95).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
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
        rates[name] = (s["samples_per_s"], s["samples_per_s_steady"])
        print(f"latency: {name}: {s['samples']} samples, {s['samples_per_s']:.1f} samples/s (simulated), trainer idle "
              f"{s['trainer_idle']:.2f}, {calls:.0f} teacher calls, {summary['wall_s']:.0f} wall s", flush=True)  # fmt: skip
    (none, none_steady), (slow, slow_steady) = rates["no latency"], rates["uniform[1, 40] s"]
    print(f"\n| teacher latency | samples/s, whole run | samples/s after the first version |\n|---|---|---|\n"
          f"| none | {none:.1f} | {none_steady:.1f} |\n| uniform[1, 40] s | {slow:.1f} | {slow_steady:.1f} |\n"
          f"\nthroughput ratio (slow / none): {slow / none:.3f} whole run, {slow_steady / none_steady:.3f} after the "
          "first version")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="latency", choices=["latency"])
    ap.add_argument("--versions", type=int, default=3, help="weight versions per run")
    ap.add_argument("--time-scale", type=float, default=5.0, help="simulated seconds per wall second")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    latency(args.versions, args.time_scale)


if __name__ == "__main__":
    main()
