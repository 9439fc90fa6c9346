"""Entry point: python -m fully_async.runner [group=option ...] [key=value ...]

Validates the config (before any heavy import), prints the effective limits, then runs the job.
`--cfg job` prints the composed config; `hydra.run.dir=...` chooses the run directory.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from fully_async.config import ConfigError, build_config, check_overrides, register_defaults

# Hydra flags that take a value: their value is not an override.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}  # fmt: skip


def _overrides(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _FLAGS_WITH_VALUE
        else:
            out.append(arg)
    return out


@hydra.main(config_path="config", config_name="fully_async", version_base=None)
def main(composed: DictConfig) -> None:
    try:
        cfg = build_config(composed)
    except ConfigError as e:  # Hydra would print a traceback; the message alone says what to fix
        print(f"ConfigError: {e}", file=sys.stderr)
        sys.exit(2)
    print("fully_async: effective limits:", ", ".join(f"{k}={v}" for k, v in cfg.limits().items()), flush=True)
    print("fully_async: the end-to-end run (rollouter, trainer, param sync) is not implemented yet", flush=True)


def cli() -> int:
    try:
        check_overrides(_overrides(sys.argv[1:]))
        register_defaults()
        main()
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
