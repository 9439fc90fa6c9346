"""Reward shaping applied to each scored sample (after its sources, before reward.group_fn), and the test of DAPO's
dynamic sampling on a finished group."""

from __future__ import annotations


def overlong_penalty(length: int, budget: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to `budget - buffer` response tokens, then falling linearly to
    `-penalty` at `budget` (and no lower). `buffer` = 0 turns it off."""
    if buffer <= 0:
        return 0.0
    excess = length - (budget - buffer)
    return -penalty * min(1.0, max(0, excess) / buffer)


def group_values(trajs, metric: str) -> list[float] | None:
    """The per-sample values dynamic sampling compares: each trajectory's reward (metric 'reward') or the numeric
    `metric` key of its reward info; None when a trajectory lacks it."""
    out = []
    for t in trajs:
        value = t.reward if metric == "reward" else (t.reward_info or {}).get(metric)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        out.append(float(value))
    return out


def is_constant(values: list[float]) -> bool:
    """All values equal (a group with zero reward variance has zero group-relative advantage: nothing to learn)."""
    return max(values) - min(values) <= 1e-9 * max(1.0, abs(max(values)))
