"""Pipeline schedules compared on one simulation profile, same number of samples each, in one invocation.

    .venv/bin/python scripts/bench/pipeline.py                                   # every schedule, verl 128-GPU profile
    .venv/bin/python scripts/bench/pipeline.py --versions 2 --time-scale 20      # quicker, noisier
    .venv/bin/python scripts/bench/pipeline.py --schedules async_eta2_partial --scale-engines 256 --samples 100000

Schedules (overrides on the profile; docs/sim.md says why each is what it claims to be):
  colocated_sync      all GPUs generate a whole batch, then all of them train on it (eta=0, one step per version,
                      the engines idle while training), at the per-GPU rates verl measured for its colocated run
  separate_eta0       separate rollout and train GPUs, max_staleness=0 (streaming on-policy)
  one_step_off        separate, max_staleness=1, the sync waits for in-flight samples (drain_on_sync)
  async_eta{1,2,4}_partial / _restart
                      fully async, partial rollout on (abort and continue) or off (abort and restart)

Per schedule: wall time, samples/s, tokens/s (simulated seconds: wall x time scale), trainer and rollouter idle
ratios, staleness mean/max, efficiency = throughput / analytic bound (fully_async/simulation.py), speedups over
colocated_sync and separate_eta0, and the CPU seconds all processes of the run spent per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import psutil  # noqa: E402

from fully_async.config import compose  # noqa: E402
from fully_async.simulation import capacity, run_schedule, summarize  # noqa: E402

# verl's colocated 128-GPU row (docs/sim.md): per-GPU training throughput while the engines' memory stays reserved,
# the old-log-prob pass it runs, and the 10.7 s per step outside generation and training (weight resharding, wake-up).
COLOCATED = [
    "trainer.sim.train_tokens_per_s_per_gpu=685",
    "trainer.sim.logprob_tokens_per_s_per_gpu=1243",
    "algorithm.rollout_correction.bypass_mode=false",
    "engine.sim.reload_s=9.2",
]


def schedules(profile) -> dict[str, list[str]]:
    at, engines, gpus = profile.async_training, profile.engine.num_servers, profile.trainer.sim.gpus
    per_engine = profile.rollout.max_concurrent // engines
    out = {
        "colocated_sync": [
            *COLOCATED,
            f"engine.num_servers={2 * engines}",
            f"trainer.sim.gpus={2 * gpus}",
            f"rollout.max_concurrent={2 * engines * per_engine}",
            "async_training.max_staleness=0",
            "async_training.sync_every=1",
            f"async_training.groups_per_step={at.groups_per_version}",
            f"trainer.num_mini_batches={profile.trainer.num_mini_batches * at.sync_every}",
        ],
        "separate_eta0": ["async_training.max_staleness=0"],
        "one_step_off": ["async_training.max_staleness=1", "async_training.drain_on_sync=true"],
    }
    for eta in (1, 2, 4):
        for partial in (True, False):
            name = f"async_eta{eta}_{'partial' if partial else 'restart'}"
            out[name] = [
                f"async_training.max_staleness={eta}",
                f"async_training.partial_rollout={str(partial).lower()}",
            ]
    return out


def cpu_by_process() -> dict[str, float]:
    """CPU seconds of this process and every descendant (Ray's GCS, raylet and workers, reaped children included),
    by process title."""
    out: dict[str, float] = {}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            name = "driver" if p.pid == me.pid else (p.cmdline() or [p.name()])[0].split("/")[-1][:40]
        except psutil.Error:
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system + t.children_user + t.children_system
    return out


def cpu_seconds() -> float:
    return sum(cpu_by_process().values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=str(REPO / "examples/sim_verl128"), help="folder with the profile config.yaml")
    ap.add_argument("--versions", type=int, default=4, help="weight versions per schedule (sets the sample count)")
    ap.add_argument("--samples", type=int, default=0, help="samples per schedule (overrides --versions)")
    ap.add_argument("--time-scale", type=float, default=10.0, help="simulated seconds per wall second")
    ap.add_argument("--scale-engines", type=int, default=0, help="engines (trainer GPUs scale along); 0 = profile")
    ap.add_argument("--schedules", default="all", help="comma-separated names, or all")
    ap.add_argument("--out", default="", help="run directories go here (default: a temporary folder)")
    ap.add_argument("--report", default="", help="only print the table of the runs already in this folder")
    ap.add_argument("overrides", nargs="*", help="key=value overrides applied to every schedule")
    args = ap.parse_args()
    if args.report:
        runs = sorted(Path(args.report).glob("*/bench.json"), key=lambda p: p.stat().st_mtime)
        results = {r.parent.name: evaluate(r.parent) for r in runs}
        report(results, next(iter(results.values()))["time_scale"] if results else 1.0)
        return 0

    scale = [f"engine.sim.time_scale={args.time_scale}", f"trainer.sim.time_scale={args.time_scale}"]
    base = compose(list(args.overrides), config_dir=args.profile, config_name="config")
    if args.scale_engines:
        factor = args.scale_engines / base.engine.num_servers
        per_engine = base.rollout.max_concurrent // base.engine.num_servers
        scale += [
            f"engine.num_servers={args.scale_engines}",
            f"trainer.sim.gpus={max(1, round(base.trainer.sim.gpus * factor))}",
            f"rollout.max_concurrent={args.scale_engines * per_engine}",
            f"async_training.groups_per_step={max(1, round(base.async_training.groups_per_step * factor))}",
        ]
    profile = compose([*args.overrides, *scale], config_dir=args.profile, config_name="config")
    plan = schedules(profile)
    names = list(plan) if args.schedules == "all" else args.schedules.split(",")
    unknown = [n for n in names if n not in plan]
    if unknown:
        ap.error(f"unknown schedules {unknown}; choose from {list(plan)}")
    per_version = profile.async_training.groups_per_version * profile.rollout.n
    versions = max(1, -(-args.samples // per_version)) if args.samples else args.versions

    import ray
    from transformers import AutoTokenizer

    from fully_async.agents import Sample
    from fully_async.agents.sim import SimAgentLoop
    from fully_async.data import dataset
    from fully_async.engines import Sampling
    from fully_async.models import resolve_run_model
    from fully_async.protocol import PromptRef

    model_path = str(resolve_run_model(profile))
    loop = SimAgentLoop(AutoTokenizer.from_pretrained(model_path), Sampling(), 1)
    rows = dataset(profile, "train")[:64]
    prompt_tokens = sum(len(loop.prompt_ids(Sample(PromptRef(0, i), 0, r))) for i, r in enumerate(rows)) / len(rows)

    out_root = Path(args.out or tempfile.mkdtemp(prefix="fully_async-pipeline-"))
    print(f"profile {args.profile}; {profile.engine.num_servers} engines, trainer {profile.trainer.sim.gpus} GPUs; "
          f"{versions} versions x {per_version} samples per schedule; time scale {args.time_scale:g} (simulated s "
          f"per wall s: every time below is simulated); runs in {out_root}", flush=True)  # fmt: skip
    ray.init(include_dashboard=False, num_cpus=16, logging_level="ERROR", log_to_driver=False)
    results = {}
    try:
        for name in names:
            overrides = [*args.overrides, *scale, *plan[name]]
            cfg = compose(overrides, config_dir=args.profile, config_name="config")
            groups = versions * per_version // cfg.rollout.n
            steps = max(1, groups // cfg.async_training.groups_per_step, cfg.async_training.sync_every)
            overrides.append(f"trainer.total_steps={steps}")
            cfg.trainer.total_steps = steps
            before = cpu_by_process()
            ran = run_schedule(cfg, out_root / name, model_path, cpu_clock=cpu_seconds)
            after = cpu_by_process()
            split = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0.5}
            print(
                f"{name}: CPU s by process (start-up and shutdown included): "
                + ", ".join(f"{k} {v:.1f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1])),
                flush=True,
            )
            record = {"profile": args.profile, "overrides": overrides, "cpu_s": ran["cpu_s"], "wall_s": ran["wall_s"],
                      "generated": ran["rollouter"]["samples"], "prompt_tokens": prompt_tokens,
                      "colocated": name == "colocated_sync", "cpu_by_process": split}  # fmt: skip
            (out_root / name / "bench.json").write_text(json.dumps(record, indent=1))
            s = results[name] = evaluate(out_root / name)
            print(f"{name}: {s['samples']} samples in {ran['wall_s']:.0f} wall s, {s['samples_per_s']:.1f} "
                  f"samples/s, efficiency {s['efficiency']:.3f} (steady {s['efficiency_steady']:.3f}), "
                  f"{s['cpu_ms_per_sample']:.2f} ms CPU per trained sample, {s['cpu_ms_per_generated']:.2f} per "
                  f"generated ({s['generated']} generated)", flush=True)  # fmt: skip
    finally:
        ray.shutdown()
    report(results, args.time_scale)
    return 0


def evaluate(run_dir: Path) -> dict:
    """Summary and efficiencies of one finished schedule, from its files and bench.json.

    efficiency: samples/s over the whole trainer loop / the bound at the profile's mean response length;
    eff. len: the same throughput / the bound at the mean length of the samples actually trained;
    eff. steady: throughput after the first version / the bound at those samples' mean length."""
    rec = json.loads((run_dir / "bench.json").read_text())
    cfg = compose(rec["overrides"], config_dir=rec["profile"], config_name="config")
    s = summarize(run_dir, cfg)
    p, colocated = rec["prompt_tokens"], rec["colocated"]
    s.update(capacity(cfg, p, colocated=colocated))
    s["efficiency"] = s["samples_per_s"] / s["bound"]
    s["efficiency_len"] = s["samples_per_s"] / capacity(cfg, p, colocated, s["trained_length"])["bound"]
    s["efficiency_steady"] = (
        s["samples_per_s_steady"] / capacity(cfg, p, colocated, s["trained_length_steady"])["bound"]
    )
    s.update(generated=rec["generated"], time_scale=cfg.engine.sim.time_scale)
    s.update(
        cpu_ms_per_sample=1000 * rec["cpu_s"] / s["samples"],
        cpu_ms_per_generated=1000 * rec["cpu_s"] / rec["generated"],
    )
    return s


def report(results: dict, time_scale: float) -> None:
    ref1, ref2 = results.get("colocated_sync"), results.get("separate_eta0")
    print(f"\nAll times simulated (wall x {time_scale:g}); bound = analytic min(generation, training) capacity.")
    head = ("schedule", "samples", "wall s", "samples/s", "tokens/s", "idle T", "idle R", "stale mean", "stale max",
            "partial", "dropped", "sync %", "efficiency", "eff. len", "eff. steady", "x sync", "x eta0", "CPU ms/sample",
            "CPU ms/generated")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, s in results.items():
        x1 = f"{s['samples_per_s'] / ref1['samples_per_s']:.2f}" if ref1 else "-"
        x2 = f"{s['samples_per_s'] / ref2['samples_per_s']:.2f}" if ref2 else "-"
        cells = (name, s["samples"], f"{s['sim_wall_s']:.0f}", f"{s['samples_per_s']:.1f}", f"{s['tokens_per_s']:,.0f}",
                 f"{s['trainer_idle']:.2f}", f"{s['rollouter_idle']:.2f}", f"{s['staleness_mean']:.2f}",
                 s["staleness_max"], f"{s['partial_ratio']:.3f}", s["dropped_stale"], f"{100 * s['sync_s'] / s['sim_wall_s']:.1f}", f"{s['efficiency']:.3f}",
                 f"{s['efficiency_len']:.3f}", f"{s['efficiency_steady']:.3f}", x1, x2, f"{s['cpu_ms_per_sample']:.2f}",
                 f"{s['cpu_ms_per_generated']:.2f}")  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")
    any_s = next(iter(results.values()), None)
    if any_s:
        print(f"\nmean response length {any_s['mean_response_length']:.0f} tokens; bound per schedule: "
              + ", ".join(f"{n} {s['bound']:.1f}" for n, s in results.items()) + " samples/s")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
