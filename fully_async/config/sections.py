"""Config sections, one dataclass per role. Each field carries a one-line docstring (read by `field_docs` for error
messages and the generated reference); each section's `validate_section(prefix)` raises ConfigError.

No torch or ray imports here: the runner validates config before any heavy import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import PATH, PATHS, ConfigError, require

DOTTED_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _check_dotted(key: str, value: str | None) -> None:
    if value is not None and not DOTTED_PATH.match(value):
        raise ConfigError(f"{key} must be a dotted path 'package.module:attribute', got {value!r}")


@dataclass
class AsyncTrainingConfig:
    max_staleness: int = 1
    """Staleness bound eta in versions: no trajectory with trainer_version - min_token_version > eta is trained; 0 = synchronous on-policy."""
    sync_every: int = 1
    """Trainer steps per weight sync; every sync bumps the version by one."""
    partial_rollout: bool = True
    """At a weight sync keep the tokens generated so far and continue under the new weights (false: restart the sample)."""
    groups_per_step: int = 8
    """Prompt groups (rollout.n samples each) consumed by one trainer step."""
    queue_capacity: int = 0
    """MessageQueue capacity in groups; 0 = (max_staleness + 1) * groups_per_step * sync_every, what the bound can fill."""
    get_timeout_s: float = 1800.0
    """How long the trainer waits for a batch before failing the run with the queue and rollouter state."""
    sync_timeout_s: float = 300.0
    """Timeout of each weight-sync phase (pause, the transport's phases, resume); passing it fails the run naming the phase."""
    drain_on_sync: bool = False
    """At a weight sync let in-flight samples finish instead of aborting them (one-step-off and synchronous schedules)."""
    weight_transport: Literal["disk", "collective", "auto"] = "auto"
    """How weights reach the engines: disk (safetensors under /dev/shm that every engine reloads), collective (a gloo/nccl broadcast from the trainer into every vLLM worker), auto (= disk for now; see docs/weight-transports.md)."""
    bucket_mb: int = 16
    """Size of each flat bucket the collective weight transport broadcasts (engines load one while the next is on the wire; 16: fastest of 16/64/256 in docs/benchmarks.md)."""

    @property
    def groups_per_version(self) -> int:
        """Groups consumed between two weight syncs."""
        return self.groups_per_step * self.sync_every

    def effective_queue_capacity(self) -> int:
        return self.queue_capacity or (self.max_staleness + 1) * self.groups_per_version

    def validate_section(self, p: str) -> None:
        require(self.max_staleness >= 0, p + "max_staleness", self.max_staleness, ">= 0")
        require(self.sync_every >= 1, p + "sync_every", self.sync_every, ">= 1")
        require(self.groups_per_step >= 1, p + "groups_per_step", self.groups_per_step, ">= 1")
        bound = (self.max_staleness + 1) * self.groups_per_version
        require(
            self.queue_capacity == 0 or self.queue_capacity >= bound,
            p + "queue_capacity",
            self.queue_capacity,
            f"0 (derived) or >= (max_staleness + 1) * groups_per_step * sync_every = {bound}, what admission can fill "
            "(a smaller queue would stall producers that the staleness rule already admitted)",
        )
        require(self.get_timeout_s > 0, p + "get_timeout_s", self.get_timeout_s, "> 0")
        require(self.sync_timeout_s > 0, p + "sync_timeout_s", self.sync_timeout_s, "> 0")
        require(self.bucket_mb >= 1, p + "bucket_mb", self.bucket_mb, ">= 1")


@dataclass
class MultiTurnConfig:
    tools: list[str] = field(default_factory=list)
    """Tools of fully_async.agents.tool:ToolAgentLoop as dotted paths 'pkg.mod:fn' of (async) functions; the schema comes from the signature or fn.tool_schema."""
    tool_config_path: str | None = None
    """YAML file of more tools in verl's format: a `tools:` list of {class_name, config, tool_schema} (OpenAI schema)."""
    max_turns: int = 4
    """Most assistant turns per episode; the episode ends after that many even if the last one called tools."""
    max_tokens_per_turn: int = 0
    """Most tokens of one assistant turn; a turn cut there is closed by an inserted end-of-turn token and the episode goes on; 0 = only the response budget limits it."""
    max_parallel_calls: int = 4
    """Most tool calls run per assistant turn (the first ones); further calls in that turn are skipped and counted."""
    max_tool_response_tokens: int = 256
    """Most tokens of one tool response; a longer one is cut and marked '...(truncated)'."""
    tool_timeout_s: float = 30.0
    """Timeout of one tool call; a call past it is cut and the model is told it timed out."""
    tool_limits: RewardLimitsConfig = field(default_factory=lambda: RewardLimitsConfig())
    """Limits of each tool's calls, the reward sources' kind (max_concurrent, rpm; scope cluster = one named Ray actor per tool for every process); the wait does not count toward tool_timeout_s; tpm must stay 0 (a tool call has no token count)."""
    limiter_namespace: str = "fully_async"
    """Ray namespace of the per-tool limiter actors: processes in one namespace share each tool's limits."""

    def validate_section(self, p: str) -> None:
        for i, path in enumerate(self.tools):
            _check_dotted(f"{p}tools[{i}]", path)
        require(self.max_turns >= 1, p + "max_turns", self.max_turns, ">= 1")
        require(self.max_tokens_per_turn >= 0, p + "max_tokens_per_turn", self.max_tokens_per_turn, ">= 0 (0 = off)")
        require(self.max_parallel_calls >= 1, p + "max_parallel_calls", self.max_parallel_calls, ">= 1")
        require(
            self.max_tool_response_tokens >= 1, p + "max_tool_response_tokens", self.max_tool_response_tokens, ">= 1"
        )
        require(self.tool_timeout_s > 0, p + "tool_timeout_s", self.tool_timeout_s, "> 0")
        require(self.tool_limits.tpm == 0, p + "tool_limits.tpm", self.tool_limits.tpm, "0 (tool calls have no tokens)")


DEFAULT_AGENT_LOOP = "fully_async.agents.single_turn:SingleTurnAgentLoop"
ROLLOUT_FN_LOOP = "fully_async.agents.rollout_fn:RolloutFnAgentLoop"
GUESS_LOOP = "fully_async.agents.guess:GuessAgentLoop"


@dataclass
class RolloutConfig:
    n: int = 4
    """Samples per prompt; the n samples of one prompt form a TrajectoryGroup."""
    max_concurrent: int = 64
    """Most samples generating at once across all engines."""
    start_concurrent: int = 0
    """Most samples of admitted, unfinished groups (rollout.n each) until the first async_training.groups_per_step groups since the (re)start have finished, then only max_concurrent applies: fewer sequences per engine decode faster, so the trainer's first batch arrives sooner instead of sharing the engines with all (max_staleness + 1) versions the staleness bound admits at once; 0 = max_concurrent // 2, = max_concurrent turns it off."""
    response_length: int = 32
    """Most response tokens per sample, kept across aborts and continuations."""
    temperature: float = 1.0
    """Sampling temperature (> 0; the trainer uses the same value for its log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    agent_loop: str = DEFAULT_AGENT_LOOP
    """Dotted path of the AgentLoop class that turns a prompt into a trajectory (fully_async/agents/base.py)."""
    rollout_fn: str | None = None
    """Dotted path 'pkg.mod:fn' of an rLLM-style `async def fn(client, tokenizer, **row)` that writes the episode as OpenAI-shaped chat calls (fully_async/agents/rollout_fn.py; replaces agent_loop); null = off."""
    val_max_concurrent: int = 16
    """Most validation samples generating at once (they share the engines with training rollouts)."""
    ignore_eos: bool = False
    """Generate exactly response_length tokens, ignoring end tokens (benchmarks and tests of long rollouts)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tools and turn limits of multi-turn agent loops (fully_async.agents.tool:ToolAgentLoop)."""

    def agent_loop_path(self) -> str:
        """The AgentLoop class that runs: agent_loop, or the rollout-function loop when rollout_fn is set."""
        return ROLLOUT_FN_LOOP if self.rollout_fn else self.agent_loop

    def effective_start_concurrent(self) -> int:
        return self.start_concurrent or max(1, self.max_concurrent // 2)

    def validate_section(self, p: str) -> None:
        _check_dotted(p + "agent_loop", self.agent_loop)
        _check_dotted(p + "rollout_fn", self.rollout_fn)
        if self.rollout_fn is not None and self.agent_loop != DEFAULT_AGENT_LOOP:
            raise ConfigError(
                f"{p}rollout_fn and {p}agent_loop={self.agent_loop!r} both choose how a sample is produced; "
                f"set only one (agent_loop to its default {DEFAULT_AGENT_LOOP!r} with rollout_fn)"
            )
        require(self.val_max_concurrent >= 1, p + "val_max_concurrent", self.val_max_concurrent, ">= 1")
        require(self.n >= 1, p + "n", self.n, ">= 1")
        require(self.max_concurrent >= 1, p + "max_concurrent", self.max_concurrent, ">= 1")
        require(
            0 <= self.start_concurrent <= self.max_concurrent,
            p + "start_concurrent",
            self.start_concurrent,
            f"0 (max_concurrent // 2) or in [1, max_concurrent = {self.max_concurrent}]",
        )
        require(self.response_length >= 1, p + "response_length", self.response_length, ">= 1")
        require(self.temperature > 0, p + "temperature", self.temperature, "> 0")
        require(0 < self.top_p <= 1, p + "top_p", self.top_p, "in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 1, p + "top_k", self.top_k, "-1 (off) or >= 1")


@dataclass
class SimEngineConfig:
    time_scale: float = 1.0
    """Simulated seconds per wall second (all sim latencies are divided by it); must equal trainer.sim.time_scale."""
    length_median: float = 64.0
    """Median response length in tokens (log-normal; rollout.response_length caps it)."""
    length_sigma: float = 0.5
    """Log-normal sigma of the response length; 0 = every response is length_median tokens."""
    decode_step_s: float = 0.01
    """Seconds of one decode step of an engine with one sequence."""
    decode_step_per_seq_s: float = 0.0001
    """Extra seconds per decode step for each sequence in the engine's batch."""
    max_seqs: int = 256
    """Sequences one engine decodes at once; further requests wait for a slot."""
    prefill_tokens_per_s: float = 50000.0
    """Prompt tokens one engine prefills per second (a request's prefill delays its first token)."""
    pause_s: float = 0.01
    """Latency of a pause (abort or keep) on all engines."""
    resume_s: float = 0.01
    """Latency of a resume on all engines."""
    reload_s: float = 0.1
    """Latency of a weight reload on all engines."""
    token_id: int = 3
    """Token id of every simulated response token; must not occur in prompts (continuations are found by it)."""
    seed: int = 0
    """Seed of the response-length draws."""

    def validate_section(self, p: str) -> None:
        for name in ("time_scale", "length_median", "decode_step_s", "prefill_tokens_per_s"):
            require(getattr(self, name) > 0, p + name, getattr(self, name), "> 0")
        for name in ("length_sigma", "decode_step_per_seq_s", "pause_s", "resume_s", "reload_s"):
            require(getattr(self, name) >= 0, p + name, getattr(self, name), ">= 0")
        require(self.max_seqs >= 1, p + "max_seqs", self.max_seqs, ">= 1")
        require(self.token_id >= 0, p + "token_id", self.token_id, ">= 0")


@dataclass
class EngineConfig:
    kind: Literal["vllm", "sglang", "sim"] = "vllm"
    """Inference engine adapter: vllm, sglang (docs/engines.md), or sim = emulated engines in the rollouter's process
    (engine.sim)."""
    num_servers: int = 1
    """Engine server processes (one model replica each), each placed by Ray on a node with its GPUs."""
    min_servers: int = 1
    """Elastic pool: `fully_async.ctl engines --remove` refuses to leave fewer servers than this."""
    max_servers: int = 0
    """Elastic pool: `fully_async.ctl engines --add` refuses to pass this many servers (0 = as many as fit)."""
    replace_retry_s: float = 30.0
    """A server whose node is gone is replaced on another node; when none has room, try again after this many seconds."""
    tensor_parallel_size: int = 1
    """GPUs per engine server (one placement-group bundle, all on one node); its tensor-parallel size on GPUs."""
    python: str | None = field(default=None, metadata=PATH)
    """Interpreter of the engine environment; null = .venv-engine/bin/python (vllm) or .venv-sglang/bin/python
    (sglang) at the repository root."""
    host: str = "auto"
    """Address the engine servers listen on; auto = 127.0.0.1 on the Rollouter's node, the node's IP elsewhere (then
    behind an auth proxy that requires the run's token)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine weight dtype; auto = float32 on CPU (bf16 log-probs drift ~1e-2), bfloat16 on GPU."""
    max_model_len: int = 512
    """Longest prompt + response the engine accepts."""
    kv_cache_gib: float = 1.0
    """KV cache size in whole GiB on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE; SGLang's --max-total-tokens from it)."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory the engine may take (GPU only)."""
    enforce_eager: bool = True
    """Skip CUDA graphs / torch.compile warm-up (faster start-up, slower decode)."""
    startup_timeout_s: float = 300.0
    """How long to wait for a server to become healthy before failing with its log tail."""
    request_timeout_s: float = 300.0
    """Per-request HTTP timeout for generation."""
    control_timeout_s: float = 60.0
    """Timeout of each control call (pause, resume, reload weights, set version)."""
    max_retries: int = 2
    """Times a request is retried on another server after a server failure."""
    resume_timeout_s: float = 600.0
    """How long a request aborted by a pause waits for the resume before failing."""
    auto_restart: bool = True
    """Restart a server whose process died (with the latest weights and version); requests go elsewhere meanwhile."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments passed to every engine server."""
    env: dict = field(default_factory=dict)
    """Extra environment variables for the engine processes."""
    router: Literal["none", "sglang"] = "none"
    """sglang: generation goes through an sglang-router in front of the servers (kind=sglang only; control calls still
    go to each server); none: the client balances over the servers itself (docs/engines.md)."""
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"
    """The router's load-balancing policy (engine.router=sglang)."""
    router_host: str = "127.0.0.1"
    """Address the router binds (engine.router=sglang); anything but loopback exposes it, unauthenticated."""
    sim: SimEngineConfig = field(default_factory=SimEngineConfig)
    """Latency model of the emulated engines (kind=sim)."""

    def validate_section(self, p: str) -> None:
        require(self.num_servers >= 1, p + "num_servers", self.num_servers, ">= 1")
        require(1 <= self.min_servers <= self.num_servers, p + "min_servers", self.min_servers,
                f">= 1 and <= engine.num_servers ({self.num_servers})")  # fmt: skip
        require(self.max_servers == 0 or self.max_servers >= self.num_servers, p + "max_servers", self.max_servers,
                f"0 (no limit) or >= engine.num_servers ({self.num_servers})")  # fmt: skip
        require(self.replace_retry_s > 0, p + "replace_retry_s", self.replace_retry_s, "> 0")
        require(self.tensor_parallel_size >= 1, p + "tensor_parallel_size", self.tensor_parallel_size, ">= 1")
        require(bool(str(self.host).strip()), p + "host", self.host, "'auto' or an address")
        require(self.max_model_len >= 2, p + "max_model_len", self.max_model_len, ">= 2")
        require(
            self.kv_cache_gib >= 1 and float(self.kv_cache_gib).is_integer(),
            p + "kv_cache_gib",
            self.kv_cache_gib,
            "a whole number >= 1 (vLLM's VLLM_CPU_KVCACHE_SPACE takes integer GiB)",
        )
        require(
            0 < self.gpu_memory_utilization <= 1, p + "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]"
        )
        for name in ("startup_timeout_s", "request_timeout_s", "control_timeout_s", "resume_timeout_s"):
            require(getattr(self, name) > 0, p + name, getattr(self, name), "> 0")
        require(self.max_retries >= 0, p + "max_retries", self.max_retries, ">= 0")
        require(self.router == "none" or self.kind == self.router, p + "router", self.router,
                f"'none' with engine.kind={self.kind} (the sglang router only fronts engine.kind=sglang)")  # fmt: skip
        require(bool(str(self.router_host).strip()), p + "router_host", self.router_host, "an address")


@dataclass
class PlacementConfig:
    resources: Literal["auto", "gpu", "cpu"] = "auto"
    """What trainer ranks and engine servers reserve from Ray: gpu = GPUs (trainer.nnodes x n_gpus_per_node, and
    engine.tensor_parallel_size per server); cpu = one CPU each; auto = gpu when the cluster declares GPUs."""
    timeout_s: float = 120.0
    """How long to wait for Ray to grant the placement groups before failing (a cluster that is still starting)."""
    engine_cpus: float = 1.0
    """Ray CPUs each engine host reserves (its server's tokenizer and API process)."""
    engine_resources: dict = field(default_factory=dict)
    """Custom Ray resources each engine server's bundle also reserves, e.g. {inference: 1}: engines then go only to
    nodes started with `--resources '{"inference": N}'` (scripts/cluster/start_worker.sh passes extra ray flags)."""
    trainer_resources: dict = field(default_factory=dict)
    """Custom Ray resources each trainer bundle also reserves (keeps the trainer ranks on the nodes that declare them)."""

    def validate_section(self, p: str) -> None:
        require(self.timeout_s > 0, p + "timeout_s", self.timeout_s, "> 0")
        require(self.engine_cpus >= 0, p + "engine_cpus", self.engine_cpus, ">= 0")
        for name in ("engine_resources", "trainer_resources"):
            for key, amount in getattr(self, name).items():
                require(isinstance(amount, int | float) and amount > 0 and key not in ("CPU", "GPU", "memory"),
                        f"{p}{name}.{key}", amount, "a custom resource (not CPU/GPU/memory) with an amount > 0")  # fmt: skip


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
    """Trainer steps in the run (each consumes async_training.groups_per_step groups)."""
    save_every: int = 0
    """Checkpoint every this many steps; 0 = only at the end."""
    save_hf: bool = True
    """The last step's checkpoint also holds the policy as a Hugging Face model in checkpoints/step_N/hf/ (safetensors in
    engine.dtype, config, generation config, tokenizer: loads with transformers, serves as model.path); any other
    checkpoint: python -m fully_async.export RUN_DIR --step N --out DIR."""
    val_every: int = 0
    """Validate every this many versions; 0 = never."""
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
        require(self.total_steps >= 1, p + "total_steps", self.total_steps, ">= 1")
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


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: a group whose rewards are all equal (zero group advantage) is not trained; it frees its staleness slot, is counted (fully_async/count/filtered_groups) and logged in trajectories.jsonl with filtered=true, and the trainer still gets async_training.groups_per_step useful groups per step. The entropy bonus and KL loss then no longer act on those prompts (docs/benchmarks.md, issue 19)."""
    metric: str = "reward"
    """What must vary within a group: reward, or a numeric key of the reward function's returned dict (e.g. acc)."""
    reissue: bool = False
    """Generate a filtered prompt again (a new group of samples) instead of counting it as done; a prompt whose groups are always constant then comes back until one varies."""

    def validate_section(self, p: str) -> None:
        require(bool(self.metric), p + "metric", self.metric, "'reward' or a reward-info key")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: a name verl's core_algos registers (docs/algorithms.md), checked against the installed verl; gae builds a critic (a value model on the trainer ranks); not remax (needs a greedy baseline rollout)."""
    policy_loss: str = "vanilla"
    """Policy loss: a name verl's core_algos registers (docs/algorithms.md), checked against the installed verl; vanilla = the clipped PPO loss on pi_theta / pi_prox."""
    policy_loss_args: dict = field(default_factory=dict)
    """Settings of the policy loss, by verl's names: clip_cov_ratio, clip_cov_lb, clip_cov_ub (clip_cov); kl_cov_ratio, ppo_kl_coef (kl_cov); dro_beta (dro, required); tau_pos, tau_neg (sapo); clip_ratio_c (dual clip of vanilla, dppo_*)."""
    gdpo_reward_keys: list[str] = field(default_factory=list)
    """adv_estimator=gdpo (required): the reward components normalised one by one, each a reward source's name or a key of the reward function's returned dict."""
    gdpo_reward_weights: list[float] = field(default_factory=list)
    """adv_estimator=gdpo: a weight per gdpo_reward_keys entry; empty = equal weights."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling: leave out groups whose rewards do not vary."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group std."""
    gamma: float = 1.0
    """adv_estimator=gae: discount per response token."""
    lam: float = 1.0
    """adv_estimator=gae: GAE lambda (1 = Monte-Carlo returns minus the critic's values, 0 = one-step TD)."""
    value_clip: float = 0.5
    """adv_estimator=gae: clip of the critic's new values around the values it gave when the batch arrived (verl's critic.cliprange_value)."""
    clip_ratio_low: float = 0.2
    """PPO clip below 1 on pi_theta / pi_prox."""
    clip_ratio_high: float = 0.28
    """PPO clip above 1 on pi_theta / pi_prox."""
    recompute_prox: bool = True
    """Recompute pi_prox with the trainer's weights (decoupled PPO); false = use the behaviour log-probs (bypass)."""
    rollout_is: Literal["token", "sequence"] = "token"
    """Level of the importance weight pi_prox / pi_behave."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the importance weight."""
    use_kl_loss: bool = False
    """Add a KL(pi_theta || pi_ref) loss term (needs a reference model)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How token losses are aggregated over the global batch."""

    def validate_section(self, p: str) -> None:
        self._validate_registry_names(p)
        require(0 <= self.clip_ratio_low < 1, p + "clip_ratio_low", self.clip_ratio_low, "in [0, 1)")
        require(self.clip_ratio_high >= 0, p + "clip_ratio_high", self.clip_ratio_high, ">= 0")
        require(self.rollout_is_threshold >= 1, p + "rollout_is_threshold", self.rollout_is_threshold, ">= 1")
        require(self.kl_loss_coef >= 0, p + "kl_loss_coef", self.kl_loss_coef, ">= 0")
        require(self.entropy_coeff >= 0, p + "entropy_coeff", self.entropy_coeff, ">= 0")
        require(0 <= self.gamma <= 1, p + "gamma", self.gamma, "in [0, 1]")
        require(0 <= self.lam <= 1, p + "lam", self.lam, "in [0, 1]")
        require(self.value_clip > 0, p + "value_clip", self.value_clip, "> 0")

    def _validate_registry_names(self, p: str) -> None:
        """Names against the installed verl's registries (read without importing verl: config/verl_registry.py),
        then what each name needs. Without verl only the second part runs (the sim backend computes no loss)."""
        from fully_async.config.base import suggest
        from fully_async.config.verl_registry import registered_names

        names = registered_names()
        est, loss = self.adv_estimator, self.policy_loss
        if names is not None:
            for key, value, valid in (("adv_estimator", est, names[0]), ("policy_loss", loss, names[1])):
                if value not in valid:
                    raise ConfigError(
                        f"{p}{key} must be a name the installed verl's core_algos registers: {list(valid)}, "
                        f"got {value!r}{suggest(value, valid)}"
                    )
        if est in NEEDS_UNBUILT:
            raise ConfigError(f"{p}adv_estimator={est} needs {NEEDS_UNBUILT[est]}, which is not built yet")
        if est in NEEDS_PROX and not self.recompute_prox:
            raise ConfigError(
                f"{p}adv_estimator={est} needs {p}recompute_prox=true (its baseline uses the trainer's pi_prox and "
                "sum of pi^2 per token, computed in the same forward pass)"
            )
        if est == "gdpo":
            require(bool(self.gdpo_reward_keys), p + "gdpo_reward_keys", self.gdpo_reward_keys,
                    "a non-empty list of reward components with adv_estimator=gdpo")  # fmt: skip
            require(
                not self.gdpo_reward_weights or len(self.gdpo_reward_weights) == len(self.gdpo_reward_keys),
                p + "gdpo_reward_weights",
                self.gdpo_reward_weights,
                f"empty (equal) or one weight per gdpo_reward_keys entry ({len(self.gdpo_reward_keys)})",
            )
        if loss == "bypass_mode" and self.recompute_prox:
            raise ConfigError(
                f"{p}policy_loss=bypass_mode needs {p}recompute_prox=false (it takes the behaviour log-probs as pi_old "
                "and computes its own importance weights)"
            )
        unknown = sorted(set(self.policy_loss_args) - set(POLICY_LOSS_ARGS))
        if unknown:
            raise ConfigError(
                f"{p}policy_loss_args has unknown keys {unknown}; allowed: {list(POLICY_LOSS_ARGS)}"
                f"{suggest(unknown[0], POLICY_LOSS_ARGS)}"
            )
        for key, value in self.policy_loss_args.items():
            require(isinstance(value, int | float) and not isinstance(value, bool), f"{p}policy_loss_args.{key}",
                    value, "a number")  # fmt: skip
        if loss == "dro" and "dro_beta" not in self.policy_loss_args:
            raise ConfigError(
                f"{p}policy_loss=dro needs {p}policy_loss_args.dro_beta (its quadratic log-ratio penalty)"
            )


NEEDS_UNBUILT = {
    "remax": "a greedy baseline rollout per prompt (verl's reward_baselines)",
}
"""Estimators verl registers that need a part fully_async does not build yet."""
NEEDS_CRITIC = ("gae",)
"""Estimators that need the critic (a value model trained beside the policy)."""
NEEDS_PROX = ("optimal_token_baseline", "tir_optimal_token_baseline")
"""Estimators whose baseline needs the proximal log-probs and sum of pi^2 per token (verl's OTB)."""
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "gdpo", "grpo_passk", "rloo", "rloo_vectorized", "opo",
                    "reinforce_plus_plus_baseline", "gpg", *NEEDS_PROX)  # fmt: skip
"""Estimators with a per-group baseline: they need rollout.n >= 2."""
POLICY_LOSS_ARGS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta",
                    "tau_pos", "tau_neg", "clip_ratio_c")  # fmt: skip
"""verl's policy-loss settings algorithm.policy_loss_args may set (PolicyLossConfig and ActorConfig fields)."""


REWARD_KINDS = ("rule", "judge", "reward_model")
GROUP_FN_NAME = "group_fn"
"""reward.group_fn's name in reward stats, metrics (fully_async/reward/group_fn/*) and reward info."""
FAILURE_POLICIES = ("fallback", "drop", "raise")
JUDGE_FIELDS = ("question", "response", "reference")


@dataclass
class RewardLimitsConfig:
    max_concurrent: int = 0
    """Most calls of this source in flight at once across the cluster; 0 = no limit."""
    rpm: float = 0.0
    """Requests per minute across the cluster (every attempt counts, retries included); 0 = no limit."""
    tpm: float = 0.0
    """Tokens per minute across the cluster: reserved from an estimate (prompt + max output), settled with the usage the API reports; 0 = no limit."""
    burst_s: float = 1.0
    """Bucket capacity in seconds of rate: how far a quiet source may burst ahead of rpm / tpm."""
    lease_s: float = 0.1
    """Each process leases permits for about this many seconds of traffic per call to the limiter actor."""
    scope: Literal["cluster", "process"] = "cluster"
    """cluster = one named Ray actor per source holds the buckets for every process; process = a limiter per process."""

    def active(self) -> bool:
        return bool(self.max_concurrent or self.rpm or self.tpm)

    def validate_section(self, p: str) -> None:
        require(self.max_concurrent >= 0, p + "max_concurrent", self.max_concurrent, ">= 0 (0 = no limit)")
        require(self.rpm >= 0, p + "rpm", self.rpm, ">= 0 (0 = no limit)")
        require(self.tpm >= 0, p + "tpm", self.tpm, ">= 0 (0 = no limit)")
        require(self.lease_s > 0, p + "lease_s", self.lease_s, "> 0")
        require(
            self.burst_s >= 2 * self.lease_s,
            p + "burst_s",
            self.burst_s,
            f">= 2 * lease_s = {2 * self.lease_s:g} (a bucket must hold a lease with room to spare)",
        )


@dataclass
class JudgeConfig:
    base_url: str | None = None
    """OpenAI-compatible endpoint, e.g. http://host:8000/v1 (required for kind=judge)."""
    model: str | None = None
    """Model name sent with every request (required for kind=judge)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (never the key itself); null = no key."""
    prompt_template: str = (
        "Grade the response to the question against the reference answer.\n\nQuestion:\n{question}\n\n"
        "Reference answer:\n{reference}\n\nResponse:\n{response}\n\n"
        "Reply with one line 'Score: X' where X is between 0 and 1."
    )
    """User message sent to the judge; placeholders {question}, {response}, {reference}."""
    score_pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    """Regular expression whose first group is the score in the judge's reply (the last match wins)."""
    score_scale: float = 1.0
    """The parsed score is divided by this (10 for a judge that scores out of 10)."""
    max_tokens: int = 64
    """Most tokens the judge may generate (also the output part of the TPM estimate)."""
    temperature: float = 0.0
    """Judge sampling temperature."""
    tokenizer: str | None = field(default=None, metadata=PATH)
    """Tokenizer directory for TPM estimates; null = the policy model's tokenizer."""

    def validate_section(self, p: str) -> None:
        import string

        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None}
        except ValueError as e:
            raise ConfigError(
                f"{p}prompt_template is not a valid template ({e}); double braces write a literal one"
            ) from None
        unknown = sorted(names - set(JUDGE_FIELDS))
        if unknown:
            raise ConfigError(
                f"{p}prompt_template uses unknown placeholders {unknown}; allowed: {list(JUDGE_FIELDS)} "
                "(double braces write a literal one)"
            )
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as e:
            raise ConfigError(f"{p}score_pattern is not a regular expression: {e}") from None
        require(pattern.groups >= 1, p + "score_pattern", self.score_pattern, "a regular expression with a group")
        require(self.score_scale > 0, p + "score_scale", self.score_scale, "> 0")
        require(self.max_tokens >= 1, p + "max_tokens", self.max_tokens, ">= 1")
        require(self.temperature >= 0, p + "temperature", self.temperature, ">= 0")


@dataclass
class RewardModelConfig:
    urls: list[str] = field(default_factory=list, metadata={"paths": True})
    """Service mode: base URLs of the vLLM / SGLang servers hosting the reward model (a list, or one URL as a string; requests go to the least busy)."""
    endpoint: Literal["classify", "pooling", "chat"] = "classify"
    """Service API: /classify or /pooling (a score head), or chat = a generative judge prompt (judge settings)."""
    model: str | None = None
    """Model name sent to the service; null = the server's only model."""
    label: int = 0
    """Which output of a classify / pooling head is the score."""
    path: str | None = field(default=None, metadata=PATH)
    """Local mode (no urls): a Hugging Face sequence-classification model loaded in a Ray worker of our own."""
    max_batch: int = 16
    """Local mode: most items per forward pass."""
    max_wait_ms: float = 20.0
    """Local mode: how long the first request of a batch waits for more before the forward pass runs."""
    num_replicas: int = 1
    """Local mode: Ray workers holding a copy of the model."""

    def validate_section(self, p: str) -> None:
        require(self.max_batch >= 1, p + "max_batch", self.max_batch, ">= 1")
        require(self.max_wait_ms >= 0, p + "max_wait_ms", self.max_wait_ms, ">= 0")
        require(self.num_replicas >= 1, p + "num_replicas", self.num_replicas, ">= 1")
        require(self.label >= 0, p + "label", self.label, ">= 0")


@dataclass
class RewardSourceConfig:
    kind: str = "rule"
    """rule (scorer chosen by data_source), judge, reward_model, or a dotted path 'pkg.mod:fn' of compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict (sync or async)."""
    name: str | None = None
    """Name in reward info, metrics and the limiter actor; null = the kind (rule, judge, reward_model, the function)."""
    weight: float = 1.0
    """A trajectory's reward is the weighted sum of its sources' scores."""
    timeout_s: float = 10.0
    """Hard timeout of one call (one attempt for judge / reward_model); a sync function's worker is killed when it passes."""
    on_failure: Literal["fallback", "drop", "raise"] = "fallback"
    """fallback = fallback_score with the failure flagged; drop = the whole group is re-issued; raise = the run fails."""
    fallback_score: float = 0.0
    """Score used (and flagged) when the source fails under on_failure=fallback."""
    retries: int = 4
    """judge / reward_model: retries after the first attempt on timeouts, connection errors, 408, 429 and 5xx."""
    backoff_s: float = 0.5
    """First retry delay; doubles per retry, with jitter, up to backoff_max_s (a Retry-After header wins)."""
    backoff_max_s: float = 30.0
    """Longest retry delay; a Retry-After longer than this ends the retries (then on_failure applies)."""
    limits: RewardLimitsConfig = field(default_factory=RewardLimitsConfig)
    """Concurrency, RPM and TPM limits of this source."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """kind=judge (and reward_model with endpoint=chat): the OpenAI-compatible endpoint, prompt and parser."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """kind=reward_model: a service (urls) or a model in our own Ray workers (path)."""

    @property
    def label(self) -> str:
        return self.name or (self.kind if self.kind in REWARD_KINDS else self.kind.rpartition(":")[2])

    def validate_section(self, p: str) -> None:
        if self.kind not in REWARD_KINDS and not DOTTED_PATH.match(self.kind):
            from fully_async.config.base import suggest

            raise ConfigError(
                f"{p}kind must be one of {list(REWARD_KINDS)} or a dotted path 'package.module:function', "
                f"got {self.kind!r}{suggest(self.kind, REWARD_KINDS)}"
            )
        require(self.timeout_s > 0, p + "timeout_s", self.timeout_s, "> 0")
        require(self.retries >= 0, p + "retries", self.retries, ">= 0")
        require(self.backoff_s >= 0, p + "backoff_s", self.backoff_s, ">= 0")
        require(self.backoff_max_s >= self.backoff_s, p + "backoff_max_s", self.backoff_max_s, ">= backoff_s")
        self.limits.validate_section(p + "limits.")
        self.judge.validate_section(p + "judge.")
        self.reward_model.validate_section(p + "reward_model.")
        if self.kind == "judge" or (self.kind == "reward_model" and self.reward_model.endpoint == "chat"):
            for key in ("base_url", "model"):
                if not getattr(self.judge, key) and not (self.kind == "reward_model" and key == "base_url"):
                    raise ConfigError(f"{p}judge.{key} must be set for kind={self.kind}, got null")
        if self.kind == "reward_model" and bool(self.reward_model.urls) == bool(self.reward_model.path):
            raise ConfigError(
                f"{p}reward_model needs exactly one of urls (a service) or path (a model in our Ray workers), got "
                f"urls={self.reward_model.urls!r}, path={self.reward_model.path!r}"
            )


@dataclass
class RewardConfig:
    sources: list[RewardSourceConfig] = field(default_factory=lambda: [RewardSourceConfig()])
    """Reward sources, each {kind, weight, limits, on_failure, ...}; the reward is their weighted sum."""
    num_workers: int = 2
    """Processes running synchronous reward functions (shared by every rule / dotted-path source)."""
    limiter_namespace: str = "fully_async"
    """Ray namespace of the per-source limiter actors: processes in one namespace share each source's limits."""
    group_fn: str | None = None
    """Dotted path 'pkg.mod:fn' of fn(group) -> rewards or (rewards, info), sync or async, run once all samples of a group are scored and before the group is queued; group = {prompt_uid, data_source, ground_truth, extra_info, question, samples: [{sample_index, response, reward, reward_info, response_length, finish_reason}]}, rewards = one number per sample (its new reward), info = one dict for the group or one per sample (fully_async/reward/group.py); null = off."""
    group_fn_timeout_s: float = 30.0
    """Hard timeout of one group_fn call (a sync function's worker is killed when it passes)."""
    group_fn_on_failure: Literal["fallback", "drop", "raise"] = "fallback"
    """When group_fn fails or times out: fallback = keep the per-sample scores, flagged; drop = re-issue the group; raise = the run fails."""
    overlong_buffer: int = 0
    """DAPO overlong reward shaping: a response longer than rollout.response_length - overlong_buffer tokens loses overlong_penalty x (excess / overlong_buffer), up to overlong_penalty at the budget; 0 = off."""
    overlong_penalty: float = 1.0
    """DAPO overlong shaping: the penalty at the full response budget (the shaping is linear over the buffer)."""

    def validate_section(self, p: str) -> None:
        _check_dotted(p + "group_fn", self.group_fn)
        require(self.group_fn_timeout_s > 0, p + "group_fn_timeout_s", self.group_fn_timeout_s, "> 0")
        require(self.overlong_buffer >= 0, p + "overlong_buffer", self.overlong_buffer, ">= 0 (0 = off)")
        require(self.overlong_penalty >= 0, p + "overlong_penalty", self.overlong_penalty, ">= 0")
        require(bool(self.sources), p + "sources", self.sources, "a non-empty list of reward sources")
        require(self.num_workers >= 1, p + "num_workers", self.num_workers, ">= 1")
        seen: dict[str, int] = {}
        for i, src in enumerate(self.sources):
            src.validate_section(f"{p}sources[{i}].")
            if src.label == GROUP_FN_NAME:
                raise ConfigError(
                    f"{p}sources[{i}].name: {GROUP_FN_NAME!r} names reward.group_fn's metrics; choose another"
                )
            if src.label in seen:
                raise ConfigError(
                    f"{p}sources[{i}].name: {src.label!r} is already the name of sources[{seen[src.label]}]; "
                    "give each source its own name (it names its metrics and its limiter)"
                )
            seen[src.label] = i


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
    synthetic_task: Literal["copy", "add", "guess"] = "copy"
    """Built-in task: copy ('echo 77777' -> '7'), add ('3+4=' -> '7', sums below 10) or the multi-turn guess (a hidden digit; after a wrong guess the environment tells it, the next guess must repeat it; runs fully_async.agents.guess:GuessAgentLoop unless rollout.agent_loop names another)."""
    synthetic_env_delay_s: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """guess task: each environment answer comes after a delay drawn uniformly from [low, high] seconds (a slow tool or environment)."""

    def validate_section(self, p: str) -> None:
        require(self.max_prompt_length >= 1, p + "max_prompt_length", self.max_prompt_length, ">= 1")
        require(self.synthetic_size >= 1, p + "synthetic_size", self.synthetic_size, ">= 1")
        require(bool(self.prompt_key), p + "prompt_key", self.prompt_key, "a non-empty column name")
        d = self.synthetic_env_delay_s
        require(len(d) == 2 and 0 <= d[0] <= d[1], p + "synthetic_env_delay_s", d, "[low, high] with 0 <= low <= high")


LOGGER_BACKENDS = ("console", "jsonl", "wandb", "tensorboard")
LOGGER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}
"""Logger backends that need an optional package (installed by the extra of the same name)."""


@dataclass
class LoggerConfig:
    backends: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks, any of console, jsonl, wandb, tensorboard; `logger=[console,tensorboard]` on the command line sets this list."""
    project: str = "fully_async"
    """Project name: the wandb project, and the tag of the tensorboard run."""
    run_name: str | None = None
    """Run name in wandb and tensorboard; null = the run directory's name."""
    entity: str | None = None
    """wandb entity (team or user); null = the API key's default. The key itself comes only from WANDB_API_KEY."""
    trace: bool = True
    """Record the event trace (RUN_DIR/trace/*.jsonl) that `python -m fully_async.report RUN_DIR` renders."""

    def validate_section(self, p: str) -> None:
        import importlib.util

        from fully_async.config.base import suggest

        for i, b in enumerate(self.backends):
            if b not in LOGGER_BACKENDS:
                raise ConfigError(
                    f"{p}backends[{i}] must be one of {list(LOGGER_BACKENDS)}, got {b!r}{suggest(b, LOGGER_BACKENDS)}"
                )
            if self.backends.index(b) != i:
                raise ConfigError(f"{p}backends lists {b!r} twice: {self.backends}")
            package = LOGGER_PACKAGES.get(b)
            if package and importlib.util.find_spec(package) is None:
                raise ConfigError(
                    f"{p}backends[{i}]={b!r} needs the {package!r} package, which is not installed: "
                    f"pip install 'fully_async[{package}]' (or remove {b} from {p}backends)"
                )
