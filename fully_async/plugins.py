"""load("pkg.module:attr"): the one way a config names user code.

Every plug-in is a dotted path resolved here (a reward function may also be '/abs/path/file.py:function'): agent loops (`rollout.agent_loop`), rollout functions
(`rollout.rollout_fn`), tools (`rollout.multi_turn.tools`, a tool config's `class_name`), reward functions
(`reward.sources.<name>.kind`, `reward.group_fn`). The config checks each path's shape when it loads; the import
happens here, where the code is first needed, and a path that does not load fails with a ConfigError naming the
key, the path and what went wrong.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from fully_async.config import ConfigError


def load(path: str, key: str = "plug-in path") -> Any:
    """The object at `path` ('package.module:attr', attr may be dotted: 'mod:Class.method').

    `key` is the config key that named the path, for the error. Raises ConfigError (a ValueError) when the path is
    malformed, its module cannot be imported (missing, or its own imports fail: the cause is chained) or lacks the
    attribute.
    """
    module_name, _, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not module_name or not attr:
        raise ConfigError(f"{key} must be a dotted path 'package.module:attribute', got {path!r}")
    try:
        obj = _from_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except (ImportError, OSError, SyntaxError) as e:
        raise ConfigError(f"{key}={path!r}: cannot import module {module_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ConfigError(f"{key}={path!r}: module {module_name!r} has no attribute {attr!r}") from e
    return obj


def _from_file(path: str) -> Any:
    """The module of a Python file given by path (verl's custom_reward_function.path), imported once per process
    under a name made from its path, so two files both named reward.py stay apart."""
    name = "fully_async_file_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    if not Path(path).is_file():
        raise ImportError(f"no such file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a broken file is not cached as loaded; its error is the caller's ConfigError
        raise
    return module
