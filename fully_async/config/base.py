"""Typed-config machinery: ConfigError, strict dict -> dataclass conversion, field docstrings, key suggestions.

Imports only the standard library, so every config module loads without torch or ray.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import logging
import os
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    The message always names the full key, the offending value and what is allowed. One ConfigError may hold several
    problems (`problems`, one line each: `ConfigError.of`), so a command line is fixed in one pass, not one per run.
    """

    @property
    def problems(self) -> list[str]:
        """Every problem this error reports (one, unless built by `of`)."""
        return getattr(self, "_problems", None) or [str(self)]

    @classmethod
    def of(cls, problems: typing.Sequence[str]) -> ConfigError:
        """One error listing every problem: the problem itself when there is one, else a numbered list."""
        if len(problems) == 1:
            return cls(problems[0])
        err = cls(f"{len(problems)} problems:\n" + "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1)))
        err._problems = list(problems)
        return err


def collect(problems: list[str], fn: typing.Callable[..., T], *args: Any) -> T | None:
    """fn(*args), with a ConfigError's problems appended to `problems` instead of raised (None then)."""
    try:
        return fn(*args)
    except ConfigError as e:
        problems.extend(e.problems)
        return None


def raise_problems(problems: typing.Sequence[str]) -> None:
    """Raise one ConfigError listing `problems`, if there are any."""
    if problems:
        raise ConfigError.of(problems)


def suggest(name: str, options: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest option, or '' when nothing is close."""
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings written under each dataclass field, read from the source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "dict"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str, problems: list[str] | None = None) -> Any:
    """Convert one YAML/CLI value to the annotated type, or raise ConfigError naming the key (a section's own keys'
    problems go to `problems` when given, as in from_dict)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key} must not be null; expected {type_name(tp)}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key} must be {type_name(tp)}, got {value!r}")
    if value is None:
        raise ConfigError(f"{key} must not be null; expected {type_name(tp)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{key} must be one of {list(allowed)}, got {value!r}{suggest(str(value), map(str, allowed))}"
            )
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, key, problems)
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, typing.Sequence):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item_tp,) = get_args(tp)[:1] or (Any,)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp!r} for {key}")


PATHS = {"paths": True}
"""Field metadata of a list-of-paths key: a single string is taken as a one-item list (as verl's scripts pass
`data.train_files=~/data/gsm8k/train.parquet`) and a leading `~` of every item is expanded."""
PATH = {"path": True}
"""Field metadata of a single-path key (or null): a leading `~` is expanded."""


def _expand(value: Any) -> Any:
    return os.path.expanduser(value) if isinstance(value, str) else value


def _paths_value(value: Any, meta: Mapping[str, Any]) -> Any:
    """Apply a field's PATHS / PATH metadata to a raw value before type conversion."""
    if meta.get("paths"):
        if isinstance(value, str):
            value = [value]
        if isinstance(value, typing.Sequence) and not isinstance(value, (str, bytes)):
            value = [_expand(v) for v in value]
    elif meta.get("path"):
        value = _expand(value)
    return value


KEY_HINTS: list[typing.Callable[[str], str]] = []
"""Functions key -> a hint for an unknown key ('' where they know nothing), asked before the spelling suggestion.
fully_async.config adds verl's key table here, so this module needs no import of it (no import circle)."""


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "", problems: list[str] | None = None) -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys (with the nearest valid key, or the replacement
    of a verl key) and wrong types: all of them in one ConfigError, or, with `problems` given, appended there and the
    dataclass built with defaults in their place (so validation can report the other keys' problems too)."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    names = list(fields)
    kwargs: dict[str, Any] = {}
    raise_now = problems is None
    problems = [] if problems is None else problems
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in names:
            hint = next((h for h in (known(key) for known in KEY_HINTS) if h), "") or suggest(str(name), names)
            problems.append(f"unknown config key '{key}'{hint}; valid keys here: {', '.join(names)}")
            continue
        before = len(problems)
        converted = collect(problems, _convert, _paths_value(value, fields[name].metadata), hints[name], key, problems)
        if len(problems) == before or dataclasses.is_dataclass(converted):  # a section keeps its good keys
            kwargs[name] = converted
    if raise_now:
        raise_problems(problems)  # every unknown key and wrong type of the mapping at once
    return cls(**kwargs)


def schema_node(cls: type, path: typing.Sequence[str]) -> tuple[type | None, str | None]:
    """Resolve a dotted key against a dataclass schema.

    Returns (annotated type, None) when the key exists, or (None, error message) when it does not. Keys below a
    `dict` field are accepted as they are free-form.
    """
    node: Any = cls
    walked: list[str] = []
    for part in path:
        if get_origin(node) is list and part.isdigit():  # reward.sources.1.weight: an item of a list of sections
            node = get_args(node)[0]
            walked.append(part)
            continue
        if not dataclasses.is_dataclass(node):
            if get_origin(node) is dict or node is dict or node is Any:
                return node, None
            return None, f"'{'.'.join(walked)}' is a value, not a section; '{'.'.join(path)}' does not exist"
        names = [f.name for f in dataclasses.fields(node) if f.init]
        if part not in names:
            where = ".".join(walked) or "the top level"
            full = ".".join([*walked, part])
            near = suggest(part, names).replace("'", "'" + ".".join(walked) + ("." if walked else ""), 1)
            return None, f"unknown config key '{full}'{near}; valid keys in {where}: {', '.join(names)}"
        node = get_type_hints(node)[part]
        walked.append(part)
        # Optional[Dataclass] -> Dataclass, so nested keys of optional sections resolve.
        if get_origin(node) in (Union, types.UnionType):
            inner = [a for a in get_args(node) if dataclasses.is_dataclass(a)]
            if inner:
                node = inner[0]
    return node, None


DOTTED_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
"""A plug-in path 'package.module:attribute' (agent loops, reward functions, tools, group_fn)."""
FILE_FUNCTION = re.compile(r"^/[^:\s]*\.py:[A-Za-z_]\w*$")
"""A reward function in a Python file by absolute path, '/dir/file.py:function' (verl's custom_reward_function)."""


def check_dotted(key: str, value: str | None) -> None:
    """Raise ConfigError naming `key` unless `value` is null or a dotted path 'package.module:attribute'."""
    if value is not None and not DOTTED_PATH.match(value):
        raise ConfigError(f"{key} must be a dotted path 'package.module:attribute', got {value!r}")


def check_callable(key: str, value: str | None) -> None:
    """Raise ConfigError naming `key` unless `value` is null, a dotted path 'package.module:attribute', or a function in
    a Python file by absolute path '/dir/file.py:function' (plugins.load imports either)."""
    if value is not None and not (DOTTED_PATH.match(value) or FILE_FUNCTION.match(value)):
        raise ConfigError(f"{key} must be a dotted path 'package.module:attribute' or '/abs/path/file.py:function', "
                          f"got {value!r}")  # fmt: skip


_NOTED: set[str] = set()


def note_alias(old: str, new: str, value: Any) -> None:
    """Say once per process that an older key (renamed or moved) was read as `new`: its users' command lines and
    config files keep working, and the note tells them the key to write."""
    if old not in _NOTED:
        _NOTED.add(old)
        logging.getLogger("fully_async.config").warning("%s is an alias: read as %s=%s", old, new, value)


def require(cond: bool, key: str, value: Any, allowed: str) -> None:
    """Raise ConfigError('<key> must be <allowed>, got <value>') unless cond holds."""
    if not cond:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")


def validate_tree(cfg: Any, prefix: str = "") -> None:
    """Call validate_section(prefix) on every nested dataclass section, children first; one ConfigError lists the
    first problem of every section."""
    problems: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            collect(problems, validate_tree, value, f"{prefix}{f.name}.")
    own = getattr(cfg, "validate_section", None)
    if own is not None:
        collect(problems, own, prefix)
    raise_problems(problems)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (for printing, checkpoints and metrics)."""
    return dataclasses.asdict(cfg)


# An explicit key always wins. A preset (algorithm.rollout_correction.preset), an older key read as a newer one
# (an alias) and a built-in task's own loop fill only the keys nobody set; a key set in a YAML or on the command line
# stays, even when it equals the default. Such keys are declared with `settable(default)`: their dataclass default
# is UNSET, the Hydra defaults node holds MISSING for them (`defaults_node`), so after composition a key that no YAML
# and no override gave is still MISSING, is left out of the mapping (`without_missing`), and reaches the dataclass as
# UNSET. The section's __post_init__ then calls `resolve_unset`, which fills it from the preset or the default and
# records where each value came from (`origins`, printed by the runner's `--cfg job`).


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""The dataclass default of a `settable` field until its section's __post_init__ resolves it."""
MISSING = "???"
"""OmegaConf's 'no value given': the Hydra defaults node's value of a `settable` key."""


def settable(default: Any) -> Any:
    """A field a preset or an older key may set when no YAML or command line sets it; `default` otherwise."""
    return dataclasses.field(default=UNSET, metadata={"settable": default})


def resolve_unset(section: Any, fill: Mapping[str, Any] | None = None, origin: str = "") -> None:
    """Each `settable` field of `section` still UNSET takes fill[name] (its origin recorded as `origin`) or its
    declared default; the fields that were given are recorded (`was_given`)."""
    given, origins = set(), {}
    for f in dataclasses.fields(section):
        if "settable" not in f.metadata:
            continue
        if getattr(section, f.name) is not UNSET:
            given.add(f.name)
        elif fill is not None and f.name in fill:
            setattr(section, f.name, fill[f.name])
            origins[f.name] = origin
        else:
            setattr(section, f.name, f.metadata["settable"])
    section.__dict__["_given"] = given
    section.__dict__["_origins"] = origins


def was_given(section: Any, name: str) -> bool:
    """Whether a `settable` field was set by a YAML, the command line or a caller (not filled by resolve_unset)."""
    return name in section.__dict__.get("_given", ())


def set_from(section: Any, name: str, value: Any, origin: str) -> None:
    """Set a `settable` field from `origin` (an older key, a task) and record it; call only when not was_given."""
    setattr(section, name, value)
    section.__dict__.setdefault("_origins", {})[name] = origin


def origins(cfg: Any, prefix: str = "") -> dict[str, str]:
    """{dotted key: where its value came from} for every key a preset, an older key or a task set."""
    out = {prefix + k: v for k, v in cfg.__dict__.get("_origins", {}).items()}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(origins(value, f"{prefix}{f.name}."))
    return out


def defaults_node(cfg: Any) -> dict[str, Any]:
    """to_dict(cfg) with MISSING at every `settable` key: the Hydra defaults node, so that composition tells a key
    that a YAML or the command line set (even to its default) from one nobody set."""
    out = to_dict(cfg)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if "settable" in f.metadata:
            out[f.name] = MISSING
        elif dataclasses.is_dataclass(value):
            out[f.name] = defaults_node(value)
    return out


def without_missing(data: Any) -> Any:
    """A composed mapping less its MISSING values (keys nobody set), at every depth."""
    if isinstance(data, Mapping):
        return {k: without_missing(v) for k, v in data.items() if v != MISSING}
    if isinstance(data, list):
        return [without_missing(v) for v in data]
    return data
