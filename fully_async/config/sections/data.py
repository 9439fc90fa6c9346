"""data: dataset files and the built-in synthetic tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import PATHS, require


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list, metadata=PATHS)
    """Training data: verl-layout parquet or jsonl files (a list, or one path as a string; ~ is expanded); empty = the built-in synthetic task."""
    val_files: list[str] = field(default_factory=list, metadata=PATHS)
    """Held-out data for validation (a list, or one path as a string; ~ is expanded); empty = a held-out split of the synthetic task."""
    prompt_key: str = "prompt"
    """Column holding the prompt (chat messages or a string)."""
    max_prompt_length: int = 128
    """Prompts longer than this many tokens are rejected with their file and row."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by data.seed and the epoch)."""
    seed: int = 0
    """Shuffle seed."""
    synthetic_size: int = 2048
    """Prompts per epoch of the built-in synthetic task."""
    synthetic_task: Literal["copy", "add", "guess", "lookup", "reverse", "colors", "arith"] = "copy"
    """Built-in task: copy ('echo 77777' -> '7'), add ('3+4=' -> '7', sums below 10) or the multi-turn guess (a hidden digit; after a wrong guess the environment tells it, the next guess must repeat it; runs fully_async.agents.guess:GuessAgentLoop unless rollout.agent_loop names another) or the tool task lookup (a hidden digit only the lookup tool reveals, called by a one-letter turn; runs fully_async.agents.lookup:LookupAgentLoop unless rollout.agent_loop names another) or reverse ('reverse 472' -> '274', several tokens graded per position) or the visual colors (a 56x56 image of one color -> its letter r/g/b/y; needs a vision-language model: task=colors sets model.tiny.arch=qwen2_vl, docs/vlm.md) or arith (arithmetic word problems for a real model, graded on the final number: task=arith sets model=smollm2, docs/models.md)."""
    synthetic_reverse_length: int = 2
    """reverse task: characters per prompt (and per answer); rollout.response_length must be at least this."""
    synthetic_env_delay_s: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """guess and lookup tasks: each environment or tool answer comes after a delay drawn uniformly from [low, high] seconds (a slow tool or environment)."""

    def validate_section(self, p: str) -> None:
        require(self.max_prompt_length >= 1, p + "max_prompt_length", self.max_prompt_length, ">= 1")
        require(self.synthetic_size >= 1, p + "synthetic_size", self.synthetic_size, ">= 1")
        require(1 <= self.synthetic_reverse_length <= 32, p + "synthetic_reverse_length", self.synthetic_reverse_length,
                "in [1, 32]")  # fmt: skip
        require(bool(self.prompt_key), p + "prompt_key", self.prompt_key, "a non-empty column name")
        d = self.synthetic_env_delay_s
        require(len(d) == 2 and 0 <= d[0] <= d[1], p + "synthetic_env_delay_s", d, "[low, high] with 0 <= low <= high")
