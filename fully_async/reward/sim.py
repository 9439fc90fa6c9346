"""Reward of simulation runs: a cheap deterministic score of the decoded response (SimAgentLoop decodes a response
to its length). Async, so it runs on the rollouter's loop without a worker-process round trip per sample."""

from __future__ import annotations


async def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 for an even response length, 0.0 otherwise (0.0 for text that is not a length)."""
    return float(solution_str.isdigit() and int(solution_str) % 2 == 0)


DELAY_ENV = "FULLY_ASYNC_SIM_REWARD_DELAY_S"
"""'lo,hi': simulated seconds of a uniform per-sample reward delay for `delayed_score` (unset = no delay)."""
SCALE_ENV = "FULLY_ASYNC_SIM_TIME_SCALE"
"""The run's engine.sim.time_scale: a delay of d simulated seconds sleeps d / scale on the wall clock."""


async def delayed_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """`score` after a slow verifier's latency: uniform in [lo, hi] simulated seconds (from the environment, which a
    local Ray hands to the Rollouter: the benchmark sets it before ray.init), scaled like the rest of the simulation.
    Used by `scripts/bench/reward.py --only sim-delay`."""
    import asyncio
    import os
    import random

    spec = os.environ.get(DELAY_ENV, "")
    if spec:
        lo, hi = (float(x) for x in spec.split(","))
        await asyncio.sleep(random.uniform(lo, hi) / float(os.environ.get(SCALE_ENV, "1")))
    return await score(data_source, solution_str, ground_truth, extra_info)
