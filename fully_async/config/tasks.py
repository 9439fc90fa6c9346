"""The built-in tasks' own settings: `task=<name>` selects config/task/<name>.yaml, which sets data.synthetic_task and
whatever else the task needs to run as named (the guess task: two one-token turns and room for the environment's
answer). `data.synthetic_task=<name>` on the command line selects the same option unless `task=` is given too, so
naming the task alone is enough; the command line still overrides any key the option sets.

A synthetic task configured so that it cannot work (the guess or lookup task with one turn) is refused by
`task_problems`.
Imports only the standard library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fully_async.config.sections import GUESS_LOOP, LOOKUP_LOOP

if TYPE_CHECKING:
    from fully_async.config import FullyAsyncConfig

TASK_GROUP = "task"
TASK_KEY = "data.synthetic_task"


def with_task_option(overrides: list[str], options: list[str]) -> list[str]:
    """`data.synthetic_task=X` (a shipped task option) without a `task=` override -> also `task=X` (Hydra applies
    the command line's keys after the option's, so they still win)."""
    keys = [o.lstrip("+").partition("=")[0].strip() for o in overrides]
    if TASK_GROUP in keys or TASK_KEY not in keys:
        return overrides
    value = overrides[keys.index(TASK_KEY)].partition("=")[2].strip().strip("'\"")
    return [f"{TASK_GROUP}={value}", *overrides] if value in options else overrides


def task_problems(cfg: FullyAsyncConfig) -> list[str]:
    """Why the configured built-in task cannot run as named, one line per reason (none: it can)."""
    return _reverse_problems(cfg) + _turn_task_problems(cfg)


def _reverse_problems(cfg: FullyAsyncConfig) -> list[str]:
    """The reverse task's answer is data.synthetic_reverse_length tokens: the response must have room for them."""
    length = cfg.data.synthetic_reverse_length
    if cfg.data.train_files or cfg.data.synthetic_task != "reverse" or cfg.rollout.response_length >= length:
        return []
    return [
        f"rollout.response_length must be >= data.synthetic_reverse_length = {length} for data.synthetic_task=reverse "
        f"(the answer is one token per character), got {cfg.rollout.response_length}"
    ]


_TURN_TASKS = {
    "guess": (GUESS_LOOP, "the digit is told only after a first wrong guess", "a guess", "the environment's answer"),
    "lookup": (LOOKUP_LOOP, "the digit is told only by a first turn's tool call", "a turn", "the tool's answer"),
}
"""The multi-turn built-in tasks: their loop, and why they need two turns and one-token turns (for the messages)."""


def _turn_task_problems(cfg: FullyAsyncConfig) -> list[str]:
    task = cfg.data.synthetic_task
    if cfg.data.train_files or task not in _TURN_TASKS or cfg.agent_loop_path() != _TURN_TASKS[task][0]:
        return []
    _, why_turns, turn, reply = _TURN_TASKS[task]
    turns = cfg.rollout.multi_turn
    out = []
    if turns.max_turns < 2:
        out.append(
            f"rollout.multi_turn.max_turns must be >= 2 for data.synthetic_task={task} ({why_turns}), "
            f"got {turns.max_turns}; task={task} sets the task's settings"
        )
    if not 1 <= turns.max_tokens_per_turn < cfg.rollout.response_length:
        out.append(
            f"rollout.multi_turn.max_tokens_per_turn must be in [1, rollout.response_length = "
            f"{cfg.rollout.response_length}) for data.synthetic_task={task} ({turn} is one token and {reply} "
            f"needs room after it), got {turns.max_tokens_per_turn}; task={task} sets the task's settings"
        )
    return out
