"""The built-in multi-turn task `guess` (data.synthetic_task=guess): find a hidden digit from the environment's answers.

Each row's digit is hidden (every prompt reads the same, data.GUESS_PROMPT). A model turn is one token (with
`max_tokens_per_turn=1`; the end-of-turn token is inserted); after a wrong guess the environment answers, as a user
turn inserted through ToolAgentLoop's environment machinery (mask 0, no version): 'higher' or 'lower' (or 'digit'
when the turn was not a digit). A right guess ends the episode, as does the last allowed turn. The reward sources
score the last model turn, so a sample scores 1 when it found the digit within `max_turns` guesses.

Why it needs the earlier turns: without them the best policy is a fixed sequence of distinct guesses, which finds
the digit with probability max_turns / 10 (0.4 with 4 turns); bisecting on the answers finds every digit in 4.
Uniformly random guesses find it with 1 - 0.9^turns (0.34 with 4), fewer when a turn is not a digit.

Each answer comes after a delay drawn from the row's `extra_info.env_delay_s` = [low, high] seconds (the config's
data.synthetic_env_delay_s): a slow environment or tool, the latency fully asynchronous training is meant to hide.
"""

from __future__ import annotations

import asyncio
import random

from fully_async.agents.base import Sample
from fully_async.agents.tool import ToolAgentLoop
from fully_async.protocol import Trajectory


def guess_of(text: str) -> int | None:
    """The digit a model turn guessed (its first non-space character), or None."""
    text = text.strip()
    return int(text[0]) if text[:1].isdigit() else None


def answer(guess: int | None, digit: int) -> str | None:
    """The environment's answer to a guess: None when it is right."""
    if guess is None:
        return "digit"
    if guess == digit:
        return None
    return "higher" if digit > guess else "lower"


class GuessAgentLoop(ToolAgentLoop):
    """ToolAgentLoop without tools whose environment plays the guessing game (see the module docstring)."""

    async def environment_turn(self, sample: Sample, turn: int, text: str) -> list[dict[str, str]] | None:
        reply = answer(guess_of(text), int(sample.row.ground_truth))
        if reply is None:
            return None
        low, high = sample.row.extra_info.get("env_delay_s") or (0.0, 0.0)
        if high > 0:
            await asyncio.sleep(random.uniform(low, high))
        return [{"role": "user", "content": reply}]

    def reward_text(self, traj: Trajectory) -> str:
        """The last model turn (its decoded tokens): the reward checks it is the digit."""
        mask = traj.loss_mask.tolist()
        end = len(mask)
        while end > 0 and not mask[end - 1]:
            end -= 1
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        return self.decode(traj.response_ids[start:end].tolist())
