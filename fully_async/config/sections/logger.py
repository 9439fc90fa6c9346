"""logger: metric sinks and the event trace."""

from __future__ import annotations

from dataclasses import dataclass, field

from fully_async.config.base import ConfigError

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
