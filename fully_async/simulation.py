"""Simulation runs (engine=sim, trainer=sim): the analytic throughput bound of a profile, a driver that runs one
schedule with the real actors, and the summary of a finished run read back from its files.

Units: simulated seconds. A run at engine.sim.time_scale = s takes 1/s of the simulated time on the wall clock; the
summary converts wall times back (x s), so its throughputs are those of the emulated cluster.

Analytic bound (samples per simulated second), from the profile alone:
- generation capacity: every engine decoding c = min(max_seqs, rollout.max_concurrent / engines) sequences at
  c / (decode_step_s + decode_step_per_seq_s * c) tokens/s, divided by the mean response length E[min(L, budget)];
- training capacity: samples of one step / the step's compute time (sim backend cost model; weight syncs excluded);
- separate resources: min(generation, training); colocated (both share the GPUs, one after the other):
  1 / (1 / generation + 1 / training).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist
from typing import Any

from fully_async.config import FullyAsyncConfig


def mean_response_length(cfg: FullyAsyncConfig, points: int = 20000) -> float:
    """E[min(L, rollout.response_length)] for the log-normal of engine.sim (midpoint rule over quantiles)."""
    sim, cap = cfg.engine.sim, cfg.rollout.response_length
    if sim.length_sigma == 0:
        return float(min(max(1, round(sim.length_median)), cap))
    z = NormalDist()
    total = 0.0
    for i in range(points):
        length = sim.length_median * math.exp(sim.length_sigma * z.inv_cdf((i + 0.5) / points))
        total += min(max(1.0, length), cap)
    return total / points


def capacity(
    cfg: FullyAsyncConfig, prompt_tokens: float, colocated: bool = False, mean_len: float | None = None
) -> dict[str, float]:
    """Generation and training capacity and the bound, in samples per simulated second. `mean_len`: the mean
    response length of the samples in question (default: the profile's E[min(L, budget)])."""
    sim, tr, at = cfg.engine.sim, cfg.trainer, cfg.async_training
    engines = cfg.engine.num_servers
    mean_len = mean_len or mean_response_length(cfg)
    c = max(1.0, min(sim.max_seqs, cfg.rollout.max_concurrent / engines))
    gen = engines * c / (sim.decode_step_s + sim.decode_step_per_seq_s * c) / mean_len
    samples = at.groups_per_step * cfg.rollout.n
    tokens = samples * (mean_len + prompt_tokens)
    passes = int(not cfg.algorithm.bypass) + int(cfg.algorithm.use_kl_loss)
    step_s = tr.ppo_epochs * (
        tr.sim.optimizer_step_s * tr.num_mini_batches + tokens / (tr.sim.train_tokens_per_s_per_gpu * tr.sim.gpus)
    ) + passes * tokens / (tr.sim.logprob_tokens_per_s_per_gpu * tr.sim.gpus)
    train = samples / step_s
    bound = 1.0 / (1.0 / gen + 1.0 / train) if colocated else min(gen, train)
    return {"mean_response_length": mean_len, "gen_capacity": gen, "train_capacity": train, "bound": bound}


def run_schedule(
    cfg: FullyAsyncConfig, run_dir: str | Path, model_path: str, cpu_clock: Callable[[], float] | None = None
) -> dict[str, Any]:
    """Run one simulated job with the real actors (fully_async/job.py, as the runner does, in this process's Ray).

    Returns the trainer loop's wall seconds (`wall_s`), what `cpu_clock` advanced over the same span (`cpu_s`;
    start-up and shutdown left out) and the rollouter's final stats (`rollouter`). Ray must be initialised."""
    import ray

    from fully_async.job import Job

    run_dir = Path(run_dir)
    with Job(cfg, run_dir, model_path, weights_root=run_dir / "weights", echo=lambda line: None) as job:
        job.start()
        cpu0, start = (cpu_clock() if cpu_clock else 0.0), time.monotonic()
        job.run()
        wall = time.monotonic() - start
        cpu = cpu_clock() - cpu0 if cpu_clock else 0.0
        return {"wall_s": wall, "cpu_s": cpu, "rollouter": ray.get(job.rollouter.stats.remote())}


def summarize(run_dir: str | Path, cfg: FullyAsyncConfig) -> dict[str, Any]:
    """Throughput, idle ratios and staleness of a finished run, from metrics.jsonl and trajectories.jsonl.

    `*_steady` figures leave out the first version's steps (the pipeline filling up), which every schedule pays
    once whatever the run's length. Checkpoint writes are left out of every time. `trained_length*` are the mean
    response lengths of the samples trained (in a short run a schedule may train a length-biased subset: groups
    finish shortest first, so a run's first version is short and its later ones long)."""
    run_dir = Path(run_dir)
    scale = cfg.engine.sim.time_scale
    steps = _jsonl(run_dir / "metrics.jsonl")
    trajs = [t for t in _jsonl(run_dir / "trajectories.jsonl") if not t.get("filtered")]  # trained ones only
    # The final checkpoint (written at the last step) is no part of the pipeline's throughput.
    step_s = [(m["timing_s/step"] - m.get("timing_s/save_checkpoint", 0.0)) * scale for m in steps]
    wall = sum(step_s)
    stale = [t["trained_version"] - t["min_version"] for t in trajs]
    per_step: dict[int, list[int]] = {}
    for t in trajs:
        per_step.setdefault(t["step"], []).append(t["response_length"])
    skip = cfg.async_training.sync_every
    steady_s = sum(step_s[skip:])
    steady_lengths = [n for m in steps[skip:] for n in per_step.get(m["step"], [])]
    return {
        "steps": len(steps),
        "samples": len(trajs),
        "sim_wall_s": wall,
        "samples_per_s": len(trajs) / wall,
        "tokens_per_s": sum(t["response_length"] for t in trajs) / wall,
        "samples_per_s_steady": len(steady_lengths) / steady_s if steady_s else float("nan"),
        "trained_length": sum(t["response_length"] for t in trajs) / len(trajs),
        "trained_length_steady": sum(steady_lengths) / len(steady_lengths) if steady_lengths else float("nan"),
        "trainer_idle": sum(m["timing_s/wait_for_batch"] * scale for m in steps) / wall,
        "rollouter_idle": sum(m["fully_async/rollouter/idle_ratio"] * s for m, s in zip(steps, step_s)) / wall,
        "staleness_mean": sum(stale) / len(stale),
        "staleness_max": max(stale),
        "partial_ratio": sum(t["max_version"] > t["min_version"] for t in trajs) / len(trajs),
        "dropped_stale": steps[-1].get("fully_async/count/dropped_stale", 0),
        "sync_s": sum(m.get("timing_s/param_sync", 0.0) * scale for m in steps),
    }


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
