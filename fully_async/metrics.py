"""Metric names and per-step aggregation, trajectories.jsonl, and the end-of-run reward/staleness plot.

Names follow verl's where verl has one (timing_s/..., perf/..., fully_async/...); docs/metrics.md lists every metric.
Definitions (a step's window runs from the end of the previous step to the end of this one, both read on the
rollouter's wall clock, so consecutive windows tile the run):
- staleness of a trajectory = trainer version when it is trained - oldest version among its tokens.
- fully_async/trainer/idle_ratio = seconds the trainer waited for a batch in the window / the window's seconds.
- fully_async/rollouter/idle_ratio = 1 - engine-busy seconds / (serving engine servers x window seconds), where an
  engine is busy while it has at least one generate request in flight and a down server is not counted (see
  fully_async/trace.py: the report recomputes both ratios from the event trace with the same definitions).
- fully_async/partial/partial_ratio = share of trained trajectories whose tokens span more than one version.
- timing_s/agent_loop/slowest/{generate,reward} = the two phases of the trajectory with the longest generate + reward.
- fully_async/reward/<source>/... = per reward source, see `reward_source_metrics`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fully_async.protocol import TrajectoryGroup, flatten


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}/min": float(min(values)),
        f"{prefix}/mean": float(np.mean(values)),
        f"{prefix}/max": float(max(values)),
    }


def batch_metrics(groups: Sequence[TrajectoryGroup], trainer_version: int) -> dict[str, float]:
    """What the trained batch says about rewards, staleness, lengths and rollout timings."""
    trajs = flatten(groups)
    stale = [trainer_version - t.min_version for t in trajs]
    out = {
        "reward/mean": float(np.mean([t.reward for t in trajs])),
        "reward/max": float(max(t.reward for t in trajs)),
        "staleness/mean": float(np.mean(stale)),
        "staleness/max": float(max(stale)),
        "response_length/mean": float(np.mean([t.response_length for t in trajs])),
        "fully_async/partial/partial_ratio": float(np.mean([t.max_version > t.min_version for t in trajs])),
        "fully_async/aborted/ratio": float(np.mean([t.num_aborts > 0 for t in trajs])),
        "reward/failed_ratio": float(np.mean([bool(t.reward_info.get("reward_failed")) for t in trajs])),
    }
    out.update(_stats("timing_s/agent_loop/generate", [t.timings.get("generate_s", 0.0) for t in trajs]))
    out.update(_stats("timing_s/agent_loop/reward", [t.timings.get("reward_s", 0.0) for t in trajs]))
    slowest = max(trajs, key=lambda t: t.timings.get("generate_s", 0.0) + t.timings.get("reward_s", 0.0))
    out["timing_s/agent_loop/slowest/generate"] = float(slowest.timings.get("generate_s", 0.0))
    out["timing_s/agent_loop/slowest/reward"] = float(slowest.timings.get("reward_s", 0.0))
    out.update(_agent_metrics(trajs))
    return out


def _agent_metrics(trajs: Sequence[Any]) -> dict[str, float]:
    """Turns and tool calls of multi-turn trajectories (those whose agent loop recorded `turns`: ToolAgentLoop, a
    rollout function's last row per sample), and the rows that history edits split off."""
    out: dict[str, float] = {}
    if any("split_rows" in t.reward_info for t in trajs):  # a rollout function's samples (agents/rollout_fn.py)
        out["agent/split_rows"] = float(
            sum(t.reward_info.get("split_part", 0) < t.reward_info.get("split_rows", 1) - 1 for t in trajs)
        )
    multi = [t for t in trajs if "turns" in t.reward_info]
    if not multi:
        return out
    out.update(_stats("num_turns", [t.reward_info["turns"] for t in multi]))
    functions = [t for t in multi if "split_rows" in t.reward_info]  # rollout functions, the gateway's agents included
    if functions:  # an agent that never called the model: its own error, trained as the prompt alone
        out["agent/no_calls"] = float(sum(t.reward_info["turns"] == 0 for t in functions))
    gateway = [t.reward_info for t in multi if "gateway_calls" in t.reward_info]
    if gateway:  # request keys the gateway ignored (the run's sampling governs; docs/agents.md)
        ignored = [n for i in gateway for k, n in i.items() if k.startswith("gateway_ignored/")]
        out["gateway/ignored_keys"] = float(sum(ignored))
    out["agent/tool_calls/mean"] = float(np.mean([t.reward_info.get("tool_calls", 0) for t in multi]))
    out["agent/tool_call_ratio"] = float(np.mean([t.reward_info.get("tool_calls", 0) > 0 for t in multi]))
    out["agent/tool_error_ratio"] = float(np.mean([bool(t.reward_info.get("tool_error")) for t in multi]))
    out["agent/tool_timeouts"] = float(sum(t.reward_info.get("tool_errors/timeout", 0) for t in multi))
    out.update(_stats("timing_s/agent_loop/tool_calls", [t.timings.get("tool_s", 0.0) for t in multi]))
    if any(t.reward_info.get("env_turns") for t in multi):
        out.update(_stats("timing_s/agent_loop/env_turns", [t.timings.get("env_s", 0.0) for t in multi]))
        out["agent/env_turns/mean"] = float(np.mean([t.reward_info.get("env_turns", 0) for t in multi]))
    envs = [t for t in multi if "env_retries" in t.reward_info]  # environment loops (fully_async/envs/)
    if envs:
        out["env/infra_failures"] = float(sum(t.reward_info.get("env_infra_failures", 0) for t in envs))
        kinds = {k for t in envs for k in t.reward_info if k.startswith("env_infra/")}
        for k in sorted(kinds):  # by kind (fully_async/envs/failures.py INFRA_KINDS): env/infra/execution, ...
            out["env/infra/" + k.split("/", 1)[1]] = float(sum(t.reward_info.get(k, 0) for t in envs))
        out["env/retries"] = float(sum(t.reward_info.get("env_retries", 0) for t in envs))
        out["env/zeroed"] = float(sum(bool(t.reward_info.get("env_zeroed")) for t in envs))
    return out


def reward_source_metrics(now: dict[str, dict[str, float]], last: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per reward source, from two RewardAgent.stats() snapshots (the step's start and end): calls, timeouts,
    errors, retries, fallbacks and drops during the step; mean latency and limiter wait per call over the step;
    in-flight calls and realized RPM / TPM (last minute) at the step's end."""
    out: dict[str, float] = {}
    for name, s in now.items():
        before = last.get(name, {})

        def delta(key: str, s=s, before=before) -> float:
            return float(s.get(key, 0.0) - before.get(key, 0.0))

        p = f"fully_async/reward/{name}"
        calls = delta("calls")
        out[f"{p}/in_flight"] = float(s.get("in_flight", 0))
        for key in ("calls", "timeouts", "errors", "retries", "fallbacks", "drops"):
            out[f"{p}/{key}"] = delta(key)
        out[f"{p}/latency_s"] = delta("latency_s") / calls if calls else 0.0
        if "limiter_wait_s" in s:
            acquired = delta("limiter_acquired")
            out[f"{p}/limiter_wait_s"] = delta("limiter_wait_s") / acquired if acquired else 0.0
            out[f"{p}/realized_rpm"] = float(s.get("realized_rpm", 0.0))
            out[f"{p}/realized_tpm"] = float(s.get("realized_tpm", 0.0))
        if "tokens_scored" in s and "clock_s" in before:  # the distillation teacher (fully_async/distill/scorer.py)
            seconds = delta("clock_s")
            out[f"{p}/tokens_scored_per_s"] = delta("tokens_scored") / seconds if seconds > 0 else 0.0
    return out


def prefix_cache_metrics(now: dict[str, list[int]], last: dict[str, list[int]]) -> dict[str, float]:
    """The step's prefix-cache hit rates from two readings of the engine client's counts (engines/prefix_cache.py:
    cumulative prompt and cached prompt tokens per server index): cached / prompt tokens of the requests answered
    during the step, over all servers and per server. No entry where no prompt tokens were reported in the step
    (an engine that reports no cached tokens yields no metric, not 0)."""
    if not now:
        return {}

    def step(key: str) -> list[int]:
        before = last.get(key, [])
        return [v - (before[i] if i < len(before) else 0) for i, v in enumerate(now[key])]

    prompt, cached = step("prompt_tokens"), step("cached_tokens")
    p = "fully_async/engines/prefix_cache_hit_rate"
    out = {f"{p}/server_{i}": c / n for i, (n, c) in enumerate(zip(prompt, cached)) if n > 0}
    if sum(prompt) > 0:
        out[p] = sum(cached) / sum(prompt)
    return out


ENV_RECORD_KEYS = ("env_infra_failures", "env_retries", "env_zeroed")
"""Environment loops' counts (fully_async/envs/failures.py) copied into trajectories.jsonl when present."""


def trajectory_records(groups: Sequence[TrajectoryGroup], step: int, trainer_version: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt_uid": t.prompt_uid,
            "epoch": t.epoch,
            "sample_index": t.sample_index,
            "min_version": t.min_version,
            "max_version": t.max_version,
            "trained_version": trainer_version,
            "step": step,
            "reward": t.reward,
            "response_length": t.response_length,
            "num_aborts": t.num_aborts,
            "finish_reason": t.finish_reason,
            # Counted by the multi-turn loops (tool.py, rollout_fn.py); a single-turn loop's sample is one turn.
            "turns": t.reward_info.get("turns", 1),
            "tool_calls": t.reward_info.get("tool_calls", 0),
            "generate_s": t.timings.get("generate_s", 0.0),
            "reward_s": t.timings.get("reward_s", 0.0),
            **({"reward_failed": True} if t.reward_info.get("reward_failed") else {}),
            **{k: t.reward_info[k] for k in ENV_RECORD_KEYS if k in t.reward_info},
        }
        for t in flatten(groups)
    ]


class JsonlWriter:
    """Append-only JSON lines, flushed per write (a killed run keeps every line written)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a")

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        for r in records:
            self._f.write(json.dumps(r, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def truncate_jsonl(path: Path, max_step: int) -> int:
    """Keep only records with step <= max_step (a resumed run re-does later steps); returns lines kept."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= max_step:
                kept.append(line)
        except ValueError:
            continue  # a line cut by a kill mid-write
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)
    return len(kept)


def validation_points(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(version, held-out reward) of each validation in metrics.jsonl rows, by version: a validation is drawn at the
    step whose weights it graded (`val/version`), not at the later step that logged it (older runs: that step)."""
    return sorted((r.get("val/version", r["step"]), r["val/reward_mean"]) for r in rows if "val/reward_mean" in r)


def plot_run(metrics_path: Path, out_png: Path) -> Path | None:
    """Reward and staleness per step from metrics.jsonl, as a PNG."""
    if not metrics_path.exists():
        return None
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(steps, [r.get("reward/mean", math.nan) for r in rows], label="reward/mean")
    if val := validation_points(rows):
        a.plot(*zip(*val, strict=True), "o-", label="val/reward_mean (held-out)")
    a.set_ylabel("reward")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(steps, [r.get("staleness/mean", math.nan) for r in rows], label="staleness/mean")
    b.plot(steps, [r.get("staleness/max", math.nan) for r in rows], label="staleness/max")
    b.set_xlabel("trainer step")
    b.set_ylabel("versions")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
