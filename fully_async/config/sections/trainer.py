"""trainer: the training backend (verl or simulated), its steps, optimizer, parallelism and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import ConfigError, require


@dataclass
class SimTrainerConfig:
    time_scale: float = 1.0
    """Simulated seconds per wall second; must equal engine.sim.time_scale."""
    gpus: int = 1
    """GPUs the simulated trainer holds (its throughputs scale with it)."""
    train_tokens_per_s_per_gpu: float = 100000.0
    """Tokens (prompt + response) per second per GPU of a forward + backward pass."""
    logprob_tokens_per_s_per_gpu: float = 300000.0
    """Tokens per second per GPU of a forward-only log-prob pass (proximal, reference)."""
    optimizer_step_s: float = 0.01
    """Fixed seconds per optimizer step (trainer.num_mini_batches x ppo_epochs per update)."""
    model_gb: float = 0.1
    """Size of the weights one export writes, in GB."""
    export_gb_per_s: float = 10.0
    """Weight export throughput (gather + write), GB per second."""

    def validate_section(self, p: str) -> None:
        require(self.gpus >= 1, p + "gpus", self.gpus, ">= 1")
        for name in ("time_scale", "train_tokens_per_s_per_gpu", "logprob_tokens_per_s_per_gpu", "export_gb_per_s"):
            require(getattr(self, name) > 0, p + name, getattr(self, name), "> 0")
        for name in ("optimizer_step_s", "model_gb"):
            require(getattr(self, name) >= 0, p + name, getattr(self, name), ">= 0")


@dataclass
class TrainerConfig:
    backend: Literal["verl", "sim"] = "verl"
    """Training backend; sim = update and export times from a latency model, no gradients (trainer.sim)."""
    total_steps: int = 100
    """Trainer steps in the run (each consumes async_training.groups_per_step groups); 0 = set from total_epochs when the run starts."""
    total_epochs: int = 0
    """Also stop after this many passes over the training rows: the run starts with total_steps = min(total_steps, total_epochs x floor(rows / async_training.groups_per_step)) (verl's total_epochs); 0 = no epoch limit."""
    save_every: int = 0
    """Checkpoint every this many steps; 0 = only at the end."""
    save_hf: bool = True
    """The last step's checkpoint also holds the policy as a Hugging Face model in checkpoints/step_N/hf/ (safetensors in
    engine.dtype, config, generation config, tokenizer: loads with transformers, serves as model.path); any other
    checkpoint: python -m fully_async.export RUN_DIR --step N --out DIR."""
    val_every: int = 0
    """Validate every this many versions, and on the weights the run ends with (its last step waits for that one, as
    verl validates after training); 0 = never."""
    val_before_train: bool = False
    """Also validate once at the start, on the weights training starts from (with val_every > 0)."""
    resume: str = "none"
    """'auto' (latest checkpoint in the run dir), 'none', or a checkpoint path."""
    nnodes: int = 1
    """Nodes for the trainer."""
    n_gpus_per_node: int = 1
    """Trainer ranks per node (processes on CPU)."""
    strategy: Literal["fsdp2", "megatron"] = "fsdp2"
    """verl engine strategy (megatron needs GPUs and megatron-core)."""
    tensor_parallel_size: int = 1
    """Megatron tensor-parallel size (strategy=megatron only)."""
    pipeline_parallel_size: int = 1
    """Megatron pipeline-parallel size (strategy=megatron only)."""
    context_parallel_size: int = 1
    """Megatron context-parallel size (strategy=megatron only)."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    critic_lr: float | None = None
    """Peak learning rate of the critic (algorithm.adv_estimator=gae); None = trainer.lr. Same warm-up, schedule, decay and clip as the policy."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    max_token_len_per_gpu: int = 4096
    """Micro-batch token budget per rank (dynamic batch size)."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    num_mini_batches: int = 1
    """Optimizer steps per pass over a batch."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer ranks run; auto = cuda when available (float32 + gloo on CPU, bf16 + NCCL on GPU)."""
    call_timeout_s: float = 1800.0
    """Longest wait for the trainer ranks on one call (update, log-probs, export, checkpoint) before failing the run."""
    weight_bucket_mb: int = 512
    """Size of each safetensors file written by a weight export."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in the backward pass (memory for compute); None = on for GPUs, off on CPU, where the
    recomputation only costs time (~20% of a tiny model's update)."""
    cpu_threads_per_rank: int = 0
    """Torch threads per trainer rank on CPU; 0 = the host's cores divided by its ranks."""
    fsdp_units: Literal["auto", "layers", "model"] = "auto"
    """FSDP2 sharding units (strategy=fsdp2): layers = one per decoder layer (verl's default: one layer's weights
    gathered at a time); model = the model as one unit (no per-layer hooks, but a full unsharded copy of the weights
    during each forward/backward); auto = model for a single CPU rank, where there is nothing to shard and the
    per-layer hooks and copies cost ~2% of a small model's update, layers otherwise."""
    sim: SimTrainerConfig = field(default_factory=SimTrainerConfig)
    """Latency model of the simulated trainer (backend=sim)."""

    def validate_section(self, p: str) -> None:
        require(self.total_steps >= 1 or (self.total_steps == 0 and self.total_epochs >= 1), p + "total_steps",
                self.total_steps, ">= 1, or 0 with trainer.total_epochs >= 1 (then the epochs set it)")  # fmt: skip
        require(self.total_epochs >= 0, p + "total_epochs", self.total_epochs, ">= 0 (0 = no epoch limit)")
        for name in ("save_every", "val_every", "lr_warmup_steps"):
            require(getattr(self, name) >= 0, p + name, getattr(self, name), ">= 0")
        require(self.nnodes >= 1, p + "nnodes", self.nnodes, ">= 1")
        require(self.n_gpus_per_node >= 1, p + "n_gpus_per_node", self.n_gpus_per_node, ">= 1")
        require(self.lr > 0, p + "lr", self.lr, "> 0")
        require(self.critic_lr is None or self.critic_lr > 0, p + "critic_lr", self.critic_lr, "> 0 or null (= lr)")
        require(self.weight_decay >= 0, p + "weight_decay", self.weight_decay, ">= 0")
        require(self.grad_clip > 0, p + "grad_clip", self.grad_clip, "> 0")
        require(self.max_token_len_per_gpu >= 1, p + "max_token_len_per_gpu", self.max_token_len_per_gpu, ">= 1")
        require(self.ppo_epochs >= 1, p + "ppo_epochs", self.ppo_epochs, ">= 1")
        require(self.num_mini_batches >= 1, p + "num_mini_batches", self.num_mini_batches, ">= 1")
        require(self.call_timeout_s > 0, p + "call_timeout_s", self.call_timeout_s, "> 0")
        require(self.weight_bucket_mb >= 1, p + "weight_bucket_mb", self.weight_bucket_mb, ">= 1")
        require(
            self.cpu_threads_per_rank >= 0, p + "cpu_threads_per_rank", self.cpu_threads_per_rank, ">= 0 (0 = auto)"
        )
        world = self.nnodes * self.n_gpus_per_node
        model_parallel = 1
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
            size = getattr(self, name)
            require(size >= 1, p + name, size, ">= 1")
            if size > 1 and self.strategy != "megatron":
                raise ConfigError(f"{p}{name}={size} needs {p}strategy=megatron (fsdp2 shards data-parallel only)")
            model_parallel *= size
        if world % model_parallel:
            raise ConfigError(
                f"{p}tensor_parallel_size x pipeline_parallel_size x context_parallel_size = {model_parallel} must "
                f"divide the trainer's ranks (nnodes x n_gpus_per_node = {world})"
            )
        if self.resume not in ("auto", "none") and not self.resume.strip():
            raise ConfigError(f"{p}resume must be 'auto', 'none' or a checkpoint path, got {self.resume!r}")
