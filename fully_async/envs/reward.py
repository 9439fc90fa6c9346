"""The environment's reward as a reward source: `reward.sources=[{kind: fully_async.envs.reward:env_reward}]`.

The environment loop (openenv.py) puts the reward the environment returned into the sample's reward meta
(`extra_info['env_reward']`), so it passes through the RewardAgent like any other score: rate limits, timeouts,
timing metrics, weights and reward.group_fn apply."""

from __future__ import annotations

ENV_REWARD = "env_reward"
"""Key of the environment's reward in the meta's extra_info."""


async def env_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The environment's reward for the episode (verl signature); a sample without one is an error, never 0."""
    if not extra_info or ENV_REWARD not in extra_info:
        raise ValueError("no environment reward in extra_info: use it with fully_async.envs.openenv:OpenEnvAgentLoop")
    return {"score": float(extra_info[ENV_REWARD])}
