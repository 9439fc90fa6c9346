"""rollout.multi_turn.env: environment servers a user brings (OpenEnv), their pool and the infrastructure-failure rule."""

from __future__ import annotations

from dataclasses import dataclass, field

from fully_async.config.base import check_dotted, require

ON_EXHAUSTED = ("reissue", "zero_reward")
"""What happens to a sample whose environment failed for infrastructure reasons past the retry budget."""


@dataclass
class EnvConfig:
    app: str = "fully_async.envs.digits:app"
    """Dotted path 'pkg.mod:app' of the OpenEnv server app (openenv's create_app) the job launches `servers` times; ignored when `urls` is set."""
    urls: list[str] = field(default_factory=list)
    """Environment servers already running (e.g. http://127.0.0.1:8000); empty = the job launches `servers` processes of `app` on 127.0.0.1."""
    servers: int = 2
    """Environment server processes the job launches (each serves many concurrent episodes)."""
    max_concurrent_envs: int = 64
    """Most concurrent episodes (WebSocket sessions) one launched server holds."""
    startup_timeout_s: float = 120.0
    """Seconds a launched server has to answer /health before the run fails with its log."""
    call_timeout_s: float = 30.0
    """Timeout of one reset or step; a call past it is an infrastructure failure."""
    health_interval_s: float = 2.0
    """Seconds between the pool's health checks; a dead launched server is replaced."""
    infra_retries: int = 2
    """Times an episode whose environment failed for infrastructure reasons (refused or reset connection, timeout, 5xx, server gone, an exception inside the environment: OpenEnv's EXECUTION_ERROR, CAPACITY_REACHED, FACTORY_ERROR, SESSION_ERROR; docs/environments.md's failure table) restarts on a fresh environment."""
    on_exhausted: str = "reissue"
    """Past infra_retries: 'reissue' (the group is dropped and its prompt re-issued, so no fake reward is trained) or 'zero_reward' (the sample keeps reward 0: the naive rule, for comparison only)."""
    action_key: str = "message"
    """Field of the environment's action that carries the model's text."""
    observation_key: str = "message"
    """Field of the environment's observation whose text is shown to the model."""

    def validate_section(self, p: str) -> None:
        check_dotted(p + "app", self.app)
        for i, url in enumerate(self.urls):
            require(url.startswith(("http://", "https://")), f"{p}urls[{i}]", url, "an http(s):// URL")
        require(self.servers >= 1, p + "servers", self.servers, ">= 1")
        require(self.max_concurrent_envs >= 1, p + "max_concurrent_envs", self.max_concurrent_envs, ">= 1")
        require(self.startup_timeout_s > 0, p + "startup_timeout_s", self.startup_timeout_s, "> 0")
        require(self.call_timeout_s > 0, p + "call_timeout_s", self.call_timeout_s, "> 0")
        require(self.health_interval_s > 0, p + "health_interval_s", self.health_interval_s, "> 0")
        require(self.infra_retries >= 0, p + "infra_retries", self.infra_retries, ">= 0")
        require(
            self.on_exhausted in ON_EXHAUSTED, p + "on_exhausted", self.on_exhausted, f"one of {list(ON_EXHAUSTED)}"
        )
        require(bool(self.action_key), p + "action_key", self.action_key, "a field name")
        require(bool(self.observation_key), p + "observation_key", self.observation_key, "a field name")
