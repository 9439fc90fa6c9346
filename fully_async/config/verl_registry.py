"""The names verl's `core_algos` registers (advantage estimators, policy losses), read without importing verl.

Config validation must not import torch (the runner checks the config before any heavy import), and importing
`verl.trainer.ppo.core_algos` imports torch. So the installed verl's `core_algos.py` is parsed instead: every
`@register_adv_est(...)` and `@register_policy_loss(...)` decorator, with `AdvantageEstimator.X` members resolved
through the enum's own body. tests/unit/config/test_verl_registry.py checks that this equals the imported registries, so
a verl whose registration changes shape fails a test instead of being misread. When verl is not installed, the
names are None and validation leaves them to the training backend (the sim backend computes no advantages).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

CORE_ALGOS = ("trainer", "ppo", "core_algos.py")


def core_algos_path() -> Path | None:
    """The installed verl's core_algos.py (found without running verl's package __init__), or None."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*CORE_ALGOS)
    return path if path.is_file() else None


@functools.cache
def registered_names() -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(advantage estimator names, policy loss names) in registration order, or None without verl."""
    path = core_algos_path()
    if path is None:
        return None
    tree = ast.parse(path.read_text())
    enum: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AdvantageEstimator":
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and isinstance(stmt.targets[0], ast.Name)
                    and isinstance(stmt.value, ast.Constant)
                ):
                    enum[stmt.targets[0].id] = stmt.value.value
    found: dict[str, list[str]] = {"register_adv_est": [], "register_policy_loss": []}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.func.id in found):
                continue
            arg = dec.args[0] if dec.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found[dec.func.id].append(arg.value)
            elif isinstance(arg, ast.Attribute) and arg.attr in enum:
                found[dec.func.id].append(enum[arg.attr])
    return tuple(found["register_adv_est"]), tuple(found["register_policy_loss"])
