"""rollout.multi_turn.gateway: an agent program the user already has, trained through an OpenAI-compatible gateway."""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass, field

from fully_async.config.base import ConfigError, check_callable, require

GATEWAY_LOOP = "fully_async.gateway.loop:GatewayAgentLoop"


@dataclass
class GatewayConfig:
    command: str = ""
    """The agent, run once per episode as this command line (e.g. 'python /abs/path/my_agent.py'; split like a shell does, no shell runs it): OPENAI_BASE_URL and OPENAI_API_KEY name its session, FULLY_ASYNC_TASK (and stdin) hold the prompt's fields as JSON; its answer is a POST to FULLY_ASYNC_REWARD_URL, else the JSON file FULLY_ASYNC_ANSWER_FILE, else stdout's last line (docs/agents.md); empty = use `function`."""
    function: str | None = None
    """Or the agent as a Python callable 'pkg.mod:fn' (or '/abs/path/file.py:fn'), `fn(base_url, api_key, task) -> answer` (async, or sync run in a thread; `task`: the prompt's fields); null = use `command`."""
    cwd: str | None = None
    """Working directory of the agent command; null = the rollouter's."""
    env: dict[str, str] = field(default_factory=dict)
    """More environment variables for the agent command, on the command line as +rollout.multi_turn.gateway.env.NAME=value (the run's engine token is never passed on)."""
    host: str = "127.0.0.1"
    """Address the gateway binds; off loopback the run must have its token (engines/auth.py) and every session key is required as on loopback."""
    port: int = 0
    """Port of the gateway; 0 = a free one."""
    timeout_s: float = 300.0
    """Most seconds of the agent's own time per episode (time inside model calls, which a weight sync may pause, does not count); past it the agent is killed and the episode is an infrastructure failure."""
    infra_retries: int = 2
    """Times an episode whose agent crashed, hung past timeout_s or was killed restarts from its prompt; past them the group is re-issued (never scored)."""
    served_model_name: str = "policy"
    """The model id /v1/models lists (requests may name any model: the policy answers them all)."""

    def validate_section(self, p: str) -> None:
        check_callable(p + "function", self.function)
        if self.command and self.function:
            raise ConfigError(f"{p}command and {p}function both name the agent; set only one")
        if self.command:
            try:
                require(bool(shlex.split(self.command)), p + "command", self.command, "a command line")
            except ValueError as e:
                raise ConfigError(f"{p}command is no command line ({e}), got {self.command!r}") from e
        require(0 <= self.port < 65536, p + "port", self.port, "in [0, 65535] (0 = a free port)")
        require(self.timeout_s > 0, p + "timeout_s", self.timeout_s, "> 0")
        require(self.infra_retries >= 0, p + "infra_retries", self.infra_retries, ">= 0")
        require(bool(self.served_model_name), p + "served_model_name", self.served_model_name, "a name")
        try:
            ipaddress.ip_address(self.host)
        except ValueError as e:
            raise ConfigError(f"{p}host must be an IP address (127.0.0.1: loopback), got {self.host!r}") from e

    def check_agent(self, p: str) -> None:
        """Raise ConfigError unless the agent is named (the gateway loop needs one)."""
        if not self.command and not self.function:
            raise ConfigError(
                f"{p}command or {p}function must name the agent when rollout.agent_loop={GATEWAY_LOOP!r}, got neither"
            )
