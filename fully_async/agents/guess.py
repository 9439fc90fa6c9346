"""The built-in multi-turn task `guess` (data.synthetic_task=guess): a hidden digit, guessed over turns.

Each row's digit is hidden (every prompt reads the same, data.GUESS_PROMPT). A model turn is one token (with
`max_tokens_per_turn=1`; the end-of-turn token is inserted); after a wrong guess the environment answers, as a user
turn inserted through ToolAgentLoop's environment machinery (mask 0, no version): 'no, it is 77777' (the digit
shown REPEATS times). A right guess ends the episode, as does the last allowed turn. The reward sources score the
last model turn, so a sample scores 1 when one of its `max_turns` guesses is the digit.

Why it needs the earlier turns: the digit is only in the environment's answer to the first guess; without it the
best policy is a fixed sequence of distinct guesses, right with probability max_turns / 10 (0.2 with two turns).
Repeating the environment's digit is right every time from the second turn on.

Why not 'higher' / 'lower' (bisection, which needs every earlier answer): on this machine the tiny model from random
init had not moved from its random level (reward 0.06 over steps 30-46, 4 turns) after 46 steps, too slow for the
results run; the answer-revealing environment learns like the copy task (docs/benchmarks.md, issue 18).

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


REPEATS = 5
"""How often the environment's answer shows the digit (the copy task's lesson, data.COPY_REPEATS)."""


def answer(guess: int | None, digit: int) -> str | None:
    """The environment's answer to a guess (None: a non-digit turn): None when it is right."""
    if guess == digit:
        return None
    return f"no, it is {str(digit) * REPEATS}"


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
        return self.decode(last_turn_ids(traj))


def last_turn_ids(traj: Trajectory) -> list[int]:
    """The token ids of a trajectory's last model turn (the last run of loss-mask-1 tokens of its response)."""
    mask = traj.loss_mask.tolist()
    end = len(mask)
    while end > 0 and not mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return traj.response_ids[start:end].tolist()
