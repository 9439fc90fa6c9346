"""Reward of simulation runs: a cheap deterministic score of the decoded response (SimAgentLoop decodes a response
to its length). Async, so it runs on the rollouter's loop without a worker-process round trip per sample."""

from __future__ import annotations


async def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 for an even response length, 0.0 otherwise (0.0 for text that is not a length)."""
    return float(solution_str.isdigit() and int(solution_str) % 2 == 0)
