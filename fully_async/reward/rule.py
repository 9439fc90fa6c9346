"""Rule-based scorers shipped with the project (verl signature: data_source, solution_str, ground_truth, extra_info)."""

from __future__ import annotations

import re

_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")


def synthetic_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The built-in task: 1.0 when the response opens with the right number, 0.1 when it opens with a wrong number
    (the format is right), 0.0 otherwise. What follows the number is ignored."""
    match = _LEADING_NUMBER.match(solution_str)
    correct = bool(match) and match.group(1) == str(ground_truth).strip()
    return {"score": 1.0 if correct else (0.1 if match else 0.0), "acc": float(correct)}
