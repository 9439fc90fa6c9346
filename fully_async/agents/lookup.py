"""The built-in tool task `lookup` (data.synthetic_task=lookup): a hidden digit that only a tool call reveals.

Every prompt reads the same (data.LOOKUP_PROMPT); each row's digit is hidden in a record only the `lookup` tool reads.
A model turn is one token (`max_tokens_per_turn=1`; the end-of-turn token is inserted):

- a digit is the answer: the episode ends and the rule reward grades it (right with probability 1/10 without the tool);
- a letter (a-z, A-Z) is a call of the `lookup` tool with that letter as its query: the tool's answer, the row's
  digit shown REPEATS times ('7777777777'), is appended as a tool turn, token-exact (ToolAgentLoop's tool machinery:
  mask 0, no version, counted in reward info `tool_calls`), and the model answers in the next turn;
- any other token ends the episode unanswered (reward 0).

Why a letter and not one fixed token: the untrained tiny model draws any one byte token with probability ~0.001-0.002
(measured for '?' after this prompt and two others, seed 0), so at rollout.n=8 a fixed call token is seen once in
~60 groups and the copy of the tool's answer never gets trained. The 52 letters are ~20 % of its draws: random
sampling calls the tool now and then, and RL learns both to call it and to copy its answer. The query itself does
not change the answer (the row holds one record); what is learned is when to call a tool and how to read its reply.

Tool use is measured per step by `agent/tool_call_ratio` (share of trajectories with a tool call, fully_async/
metrics.py) beside the reward. The tool answers after a delay drawn from the row's `extra_info.env_delay_s` (the
config's data.synthetic_env_delay_s), as the guess task's environment does.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from fully_async.agents.base import Sample
from fully_async.agents.guess import last_turn_ids
from fully_async.agents.tool import ToolAgentLoop
from fully_async.agents.toolkit import Tool, ToolCall
from fully_async.protocol import Trajectory

TOOL_NAME = "lookup"
REPEATS = 10
"""How often the tool's answer shows the digit: the answering turn's context is then mostly that digit, so the copy
of it is found as the copy task's is (data.COPY_REPEATS)."""
SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "The hidden digit of this episode's record, shown ten times.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def call_of(text: str) -> ToolCall | None:
    """The tool call a one-token model turn makes (its first non-space character is an ASCII letter), or None."""
    first = text.strip()[:1]
    if first.isascii() and first.isalpha():
        return ToolCall(name=TOOL_NAME, arguments={"query": first})
    return None


class LookupAgentLoop(ToolAgentLoop):
    """ToolAgentLoop with one built-in tool, `lookup`, and the one-letter call format (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["tools"] = {TOOL_NAME: Tool(TOOL_NAME, SCHEMA, self._lookup)}
        super().__init__(*args, **kwargs)
        self._records: dict[str, tuple[str, list[float]]] = {}
        """Episode id -> (the row's digit, its tool delay [low, high] s), while the episode runs."""

    async def run(self, client: Any, sample: Sample) -> Trajectory:
        episode = f"{sample.prompt.uid}#{sample.sample_index}"
        delay = sample.row.extra_info.get("env_delay_s") or [0.0, 0.0]
        self._records[episode] = (str(sample.row.ground_truth), delay)
        try:
            return await super().run(client, sample)
        finally:
            self._records.pop(episode, None)

    async def _lookup(self, episode: str, arguments: dict[str, Any]) -> str:
        digit, (low, high) = self._records[episode]
        if high > 0:
            await asyncio.sleep(random.uniform(low, high))
        return digit * REPEATS

    def tool_calls(self, turn: int, text: str) -> list[ToolCall]:
        call = call_of(text)
        return [call] if call is not None else []

    def reward_text(self, traj: Trajectory) -> str:
        """The last model turn (its decoded tokens): the reward checks it is the digit."""
        return self.decode(last_turn_ids(traj))
