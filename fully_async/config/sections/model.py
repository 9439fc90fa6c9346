"""model: the policy model, a Hugging Face directory or the locally built tiny model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import PATH, require


@dataclass
class TinyModelConfig:
    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture of the locally built model."""
    hidden_size: int = 128
    """Hidden size."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP inner size."""
    max_position_embeddings: int = 1024
    """Longest sequence the model supports."""
    seed: int = 0
    """Seed of the random initialisation."""
    init_std: float = 0.1
    """Standard deviation of the normal initialisation of the weights. 0.1 rather than the usual 0.02: the built-in
    tasks are learned from scratch by RL, and the copy task reached 0.8 in a third fewer steps (median step 137
    against 216 over twelve seeds of the in-process screen, docs/benchmarks.md issue 4)."""

    def validate_section(self, p: str) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            require(getattr(self, name) >= 1, p + name, getattr(self, name), ">= 1")
        require(
            self.hidden_size % self.num_heads == 0,
            p + "hidden_size",
            self.hidden_size,
            f"a multiple of num_heads={self.num_heads}",
        )
        require(
            self.num_heads % self.num_kv_heads == 0,
            p + "num_kv_heads",
            self.num_kv_heads,
            f"a divisor of num_heads={self.num_heads}",
        )
        require(self.init_std > 0, p + "init_std", self.init_std, "> 0")


@dataclass
class ModelConfig:
    path: str | None = field(default=None, metadata=PATH)
    """Hugging Face model directory; null = build the tiny model (model.tiny) locally and cache it."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Settings of the locally built tiny model (used when path is null)."""
    cache_dir: str | None = field(default=None, metadata=PATH)
    """Where built tiny models are cached; null = ~/.cache/fully_async/models."""
