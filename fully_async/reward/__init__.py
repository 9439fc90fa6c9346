"""Reward scoring: rule-based functions (verl's compute_score signature) run inline, per trajectory, under limits."""

from fully_async.reward.agent import RewardAgent, RewardResult
from fully_async.reward.pool import RewardCallError, RewardTimeout, ScoringPool, resolve

__all__ = ["RewardAgent", "RewardCallError", "RewardResult", "RewardTimeout", "ScoringPool", "resolve"]
