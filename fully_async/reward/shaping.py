"""Reward shaping applied to each scored sample (after its sources, before reward.group_fn)."""

from __future__ import annotations


def overlong_penalty(length: int, budget: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to `budget - buffer` response tokens, then falling linearly to
    `-penalty` at `budget` (and no lower). `buffer` = 0 turns it off."""
    if buffer <= 0:
        return 0.0
    excess = length - (budget - buffer)
    return -penalty * min(1.0, max(0, excess) / buffer)
