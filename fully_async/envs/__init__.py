"""Environments users bring: OpenEnv servers (openenv.py) in a pool of processes (pool.py), the infrastructure-failure
rule (failures.py), the environment's reward through the RewardAgent (reward.py). Optional packages come from the
`envs` extra (`pip install -e .[envs]`); `require()` names it when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA = "envs"

MAX_CONCURRENT_ENV = "FULLY_ASYNC_ENV_MAX_CONCURRENT"
"""Environment variable the pool sets for a launched server: most concurrent sessions it holds (rollout.multi_turn.env)."""


def require(module: str, package: str) -> ModuleType:
    """Import `module` or raise ImportError naming the pip package and the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is missing: install the environments extra (`pip install -e .[{EXTRA}]`, or "
            f"`FULLY_ASYNC_EXTRAS={EXTRA} bash scripts/setup.sh`), which brings {package}"
        ) from e
