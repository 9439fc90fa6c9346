"""Rule-based scorers shipped with the project (verl signature: data_source, solution_str, ground_truth, extra_info)."""

from __future__ import annotations

from fully_async.tasks.arith import arith_score


def synthetic_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The built-in tasks: 1.0 when the response opens with the answer, else 0.0. What follows the answer is ignored,
    so a policy that has not yet learned to stop still gets credit for the right digit.

    No partial credit for a wrong digit: it paid the policy for being confident and wrong, so a prompt whose answer
    had collapsed onto another digit scored 0.1 on every sample, its GRPO group had no variance, and it never
    recovered (docs/benchmarks.md, issue 4: on the five-fold copy prompt, 18 unlearned digits over twelve in-process
    seeds with a 0.1 credit, 1 without)."""
    if (extra_info or {}).get("task") == "arith":  # a real model's worded answer: graded on its final number
        return arith_score(solution_str, ground_truth)
    text, answer = solution_str.lstrip(), str(ground_truth).strip()
    correct = bool(answer) and text.startswith(answer)
    if (extra_info or {}).get("task") == "reverse":
        return {"score": reverse_score(text, answer), "acc": float(correct)}
    return {"score": float(correct), "acc": float(correct)}


def reverse_score(text: str, answer: str) -> float:
    """The reverse task: the fraction of the answer's positions the response opens with the right character (what
    follows the answer is ignored, as for the one-digit tasks)."""
    return sum(a == b for a, b in zip(text, answer)) / len(answer) if answer else 0.0


async def delayed_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The built-in task's score after `extra_info['reward_delay_s']` seconds of waiting: a stand-in for a slow remote
    verifier (sandboxed code execution, an LLM judge) in benchmarks of how well scoring overlaps generation."""
    import asyncio

    await asyncio.sleep(float((extra_info or {}).get("reward_delay_s", 0.0)))
    return synthetic_score(data_source, solution_str, ground_truth, extra_info)
