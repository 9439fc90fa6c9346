"""Rule-based scorers shipped with the project (verl signature: data_source, solution_str, ground_truth, extra_info)."""

from __future__ import annotations


def synthetic_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The built-in tasks: 1.0 when the response opens with the answer, 0.1 when it opens with another digit (the
    format is right), 0.0 otherwise. What follows the answer is ignored, so a policy that has not yet learned to
    stop still gets credit for the right digit (a stricter rule left every sample at 0.1 and GRPO without signal)."""
    text, answer = solution_str.lstrip(), str(ground_truth).strip()
    correct = bool(answer) and text.startswith(answer)
    return {"score": 1.0 if correct else (0.1 if text[:1].isdigit() else 0.0), "acc": float(correct)}


async def delayed_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The built-in task's score after `extra_info['reward_delay_s']` seconds of waiting: a stand-in for a slow remote
    verifier (sandboxed code execution, an LLM judge) in benchmarks of how well scoring overlaps generation."""
    import asyncio

    await asyncio.sleep(float((extra_info or {}).get("reward_delay_s", 0.0)))
    return synthetic_score(data_source, solution_str, ground_truth, extra_info)
