"""rollout: sampling, concurrency and the agent loop (single-turn, multi-turn tools, rollout functions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fully_async.config.base import ConfigError, check_dotted, require, resolve_unset, settable
from fully_async.config.sections.env import EnvConfig
from fully_async.config.sections.gateway import GATEWAY_LOOP, GatewayConfig
from fully_async.config.sections.reward import RewardLimitsConfig


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
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environment servers of fully_async.envs.openenv:OpenEnvAgentLoop (docs/environments.md)."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The agent program of fully_async.gateway.loop:GatewayAgentLoop and its OpenAI-compatible gateway (docs/agents.md)."""

    def validate_section(self, p: str) -> None:
        for i, path in enumerate(self.tools):
            check_dotted(f"{p}tools[{i}]", path)
        require(self.max_turns >= 1, p + "max_turns", self.max_turns, ">= 1")
        require(self.max_tokens_per_turn >= 0, p + "max_tokens_per_turn", self.max_tokens_per_turn, ">= 0 (0 = off)")
        require(self.max_parallel_calls >= 1, p + "max_parallel_calls", self.max_parallel_calls, ">= 1")
        require(
            self.max_tool_response_tokens >= 1, p + "max_tool_response_tokens", self.max_tool_response_tokens, ">= 1"
        )
        require(self.tool_timeout_s > 0, p + "tool_timeout_s", self.tool_timeout_s, "> 0")
        require(self.tool_limits.tpm == 0, p + "tool_limits.tpm", self.tool_limits.tpm, "0 (tool calls have no tokens)")


@dataclass
class ValSamplingConfig:
    temperature: float | None = None
    """Validation sampling temperature (> 0); null = rollout.temperature."""
    top_p: float | None = None
    """Validation nucleus mass in (0, 1]; null = rollout.top_p."""
    top_k: int | None = None
    """Validation top-k, -1 = off; null = rollout.top_k."""
    do_sample: bool = True
    """false = greedy validation (temperature 0; temperature, top_p and top_k are not used)."""
    n: int = 1
    """Responses per held-out prompt; val/reward_mean is the mean over all of them."""

    def validate_section(self, p: str) -> None:
        require(self.temperature is None or self.temperature > 0, p + "temperature", self.temperature, "null or > 0")
        require(self.top_p is None or 0 < self.top_p <= 1, p + "top_p", self.top_p, "null or in (0, 1]")
        require(self.top_k in (None, -1) or self.top_k >= 1, p + "top_k", self.top_k, "null, -1 (off) or >= 1")
        require(self.n >= 1, p + "n", self.n, ">= 1")


DEFAULT_AGENT_LOOP = "fully_async.agents.single_turn:SingleTurnAgentLoop"
ROLLOUT_FN_LOOP = "fully_async.agents.rollout_fn:RolloutFnAgentLoop"
GUESS_LOOP = "fully_async.agents.guess:GuessAgentLoop"
LOOKUP_LOOP = "fully_async.agents.lookup:LookupAgentLoop"


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
    agent_loop: str = settable(DEFAULT_AGENT_LOOP)
    """Dotted path of the AgentLoop class that turns a prompt into a trajectory (fully_async/agents/base.py); unset, the built-in task's own loop for data.synthetic_task=guess or lookup, else the single-turn loop (set to any value, it wins)."""
    rollout_fn: str | None = None
    """Dotted path 'pkg.mod:fn' of an rLLM-style `async def fn(client, tokenizer, **row)` that writes the episode as OpenAI-shaped chat calls (fully_async/agents/rollout_fn.py; replaces agent_loop); null = off."""
    val_max_concurrent: int = 16
    """Most validation samples generating at once (they share the engines with training rollouts)."""
    val: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    """How validation samples (verl's actor_rollout_ref.rollout.val_kwargs): its own temperature, top_p, top_k, greedy, responses per prompt."""
    ignore_eos: bool | None = None
    """Alias (older key) of advanced.ignore_eos; null = unset."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tools and turn limits of multi-turn agent loops (fully_async.agents.tool:ToolAgentLoop)."""

    def __post_init__(self) -> None:
        resolve_unset(self)  # agent_loop given or not: FullyAsyncConfig.__post_init__ may set the task's loop

    def agent_loop_path(self) -> str:
        """The AgentLoop class that runs: agent_loop, or the rollout-function loop when rollout_fn is set."""
        return ROLLOUT_FN_LOOP if self.rollout_fn else self.agent_loop

    def effective_start_concurrent(self) -> int:
        return self.start_concurrent or max(1, self.max_concurrent // 2)

    def validate_section(self, p: str) -> None:
        check_dotted(p + "agent_loop", self.agent_loop)
        check_dotted(p + "rollout_fn", self.rollout_fn)
        if self.rollout_fn is not None and self.agent_loop != DEFAULT_AGENT_LOOP:
            raise ConfigError(
                f"{p}rollout_fn and {p}agent_loop={self.agent_loop!r} both choose how a sample is produced; "
                f"set only one (agent_loop to its default {DEFAULT_AGENT_LOOP!r} with rollout_fn)"
            )
        if self.agent_loop == GATEWAY_LOOP:
            self.multi_turn.gateway.check_agent(p + "multi_turn.gateway.")
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
