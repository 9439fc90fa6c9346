"""model: the policy model, a Hugging Face directory or the locally built tiny model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import PATH, require


@dataclass
class TinyModelConfig:
    arch: Literal["qwen2", "llama", "qwen2_vl"] = "qwen2"
    """Architecture of the locally built model; qwen2_vl is the tiny vision-language model (docs/vlm.md)."""
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
    tie_word_embeddings: bool = False
    """The LM head shares the token embedding's weight (as SmolLM2's and small Qwen2's do); qwen2 and llama only."""

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
        tied = self.tie_word_embeddings
        require(not tied or self.arch != "qwen2_vl", p + "tie_word_embeddings", tied, "false for arch=qwen2_vl")


LORA_SYNCS = ("auto", "adapter", "merged")
"""Values of model.lora.sync."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's --max-lora-rank accepts (0.32); an adapter of rank r is served with the smallest one >= r."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 = off (full fine-tuning). With a rank, the trainer trains only the adapter (the base weights are
    frozen, the optimizer holds only adapter parameters) and checkpoints carry the adapter."""
    alpha: int = 16
    """LoRA alpha (the adapter's output is scaled by alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get an adapter: module names (q_proj, v_proj, ...) or ["all-linear"] (every linear layer but the
    output head)."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training."""
    lr: float | None = None
    """Peak learning rate of the adapter (same warm-up, schedule and clip as trainer.lr); null = trainer.lr. RL with
    LoRA wants a larger step than full fine-tuning: 3e-3 (3 x the default trainer.lr) on the built-in task
    (docs/lora.md). trainer.lr stays the critic's default."""
    sync: str = "auto"
    """How a version reaches the engines: adapter (only the adapter's tensors, loaded into every engine server under
    a versioned name), merged (base + adapter merged, sent through async_training.weight_transport like full
    fine-tuning) or auto (adapter where the engine can serve it, else merged, said once at start)."""

    def validate_section(self, p: str) -> None:
        require(self.rank >= 0, p + "rank", self.rank, ">= 0 (0 = off)")
        require(self.alpha > 0, p + "alpha", self.alpha, "> 0")
        require(0.0 <= self.dropout < 1.0, p + "dropout", self.dropout, "in [0, 1)")
        require(self.lr is None or self.lr > 0, p + "lr", self.lr, "> 0 or null (= trainer.lr)")
        require(
            bool(self.target_modules), p + "target_modules", self.target_modules, 'a non-empty list (or ["all-linear"])'
        )
        require(self.sync in LORA_SYNCS, p + "sync", self.sync, f"one of {list(LORA_SYNCS)}")
        if self.rank:
            require(
                self.rank <= VLLM_LORA_RANKS[-1] or self.sync == "merged",
                p + "rank",
                self.rank,
                f"<= {VLLM_LORA_RANKS[-1]} (the largest rank an engine serves) unless model.lora.sync=merged",
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def lora_on_sim(rank: int) -> str:
    """The error for LoRA with the simulated trainer (a cross-section rule, and build_backend's own check)."""
    return (
        f"model.lora.rank must be 0 with trainer.backend=sim (it has no weights to adapt), got {rank}; use "
        "trainer=verl for LoRA"
    )


@dataclass
class ModelConfig:
    path: str | None = field(default=None, metadata=PATH)
    """Hugging Face model directory; null = build the tiny model (model.tiny) locally and cache it."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Settings of the locally built tiny model (used when path is null)."""
    freeze_vision_tower: bool = True
    """A vision-language model's vision tower (with its merger) does not train: no gradient, no optimizer state, and no
    weight sync sends it (docs/vlm.md). Ignored for a text model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA training and adapter-only weight sync (docs/lora.md); model.lora.rank=0 (the default) is off."""
    cache_dir: str | None = field(default=None, metadata=PATH)
    """Where built tiny models and GGUF files' conversions are cached; null = ~/.cache/fully_async/models."""
