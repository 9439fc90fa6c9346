"""Reward scoring: rule functions (verl's compute_score signature), LLM judges and reward models, run inline per
trajectory under cluster-wide limits, timeouts, retries and per-source failure policies."""

from fully_async.reward.errors import RewardDrop, RewardFatal
from fully_async.reward.scorer import RewardAgent, RewardResult
from fully_async.reward.workers import RewardCallError, RewardTimeout, ScoringPool

__all__ = [
    "RewardAgent",
    "RewardCallError",
    "RewardDrop",
    "RewardFatal",
    "RewardResult",
    "RewardTimeout",
    "ScoringPool",
]
