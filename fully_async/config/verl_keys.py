"""A verl command line read as ours in one pass (`translate`): every key looked up in config/verl_table.py, verl's
units converted with the arithmetic printed (`staleness_threshold` -> `max_staleness`, the batch sizes ->
`groups_per_step` and `num_mini_batches`, the rollout GPUs -> engine servers, `total_rollout_steps` -> trainer steps,
`trainer.test_freq` -> `val_every`), every problem listed at once, and one compact block saying what became of each
key. Imports only the standard library (and the config dataclasses for the defaults a conversion needs).
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any

from fully_async.config.verl_table import (
    CRITIC_PATH,
    IN_DICT,
    KL_KEYS,
    MAPPED,
    MINI_BATCH,
    NUMERIC,
    ONE_OR_LIST,
    REQUIRE_BATCHES,
    REWARD_FILE,
    REWARD_NAME,
    ROLLOUT_GPUS,
    ROLLOUT_NODES,
    ROLLOUT_STEPS,
    STALENESS,
    TEST_FREQ,
    TRAIN_BATCH,
    VERL_CONFIG_FLAGS,
    is_verl_config_flag,
    plain_value,
    rule,
)


@dataclass
class Translation:
    """A command line with verl's keys read as ours."""

    overrides: list[str]
    """The command line with every read verl key replaced by ours (unread ones are left for the key check)."""
    notes: list[str] = field(default_factory=list)
    """One line per conversion: the arithmetic of what it became."""
    read: dict[str, list[str]] = field(default_factory=dict)
    """What happened to each verl key read, grouped: heading -> items (one per key)."""
    problems: list[str] = field(default_factory=list)
    """One line per verl key refused or a conversion that does not work out (the key is dropped from overrides)."""

    def said(self, heading: str, item: str) -> None:
        self.read.setdefault(heading, []).append(item)

    converted: int = 0
    """How many verl keys went into the conversions (t.notes)."""

    def keys_read(self) -> int:
        return sum(map(len, self.read.values())) + self.converted

    def summary(self, width: int = 120) -> str:
        """One compact block: a line or a few per kind of reading (every key once), then the conversions. The reasons
        are left to docs/migration-from-verl.md (a block of one reason per key ran past 50 lines for one script)."""
        if not self.read and not self.notes:
            return ""
        lines = [f"fully_async: {self.keys_read()} verl keys read (why in full: docs/migration-from-verl.md):"]
        for heading, items in self.read.items():
            lines += textwrap.wrap(f"{heading}: " + ", ".join(items), width, initial_indent="  ",
                                   subsequent_indent="      ", break_on_hyphens=False)  # fmt: skip
        lines += [f"  converted: {note}" for note in self.notes]
        return "\n".join(lines)

    def announce(self) -> None:
        if text := self.summary():
            print(text, file=sys.stderr)


def _number(key: str, value: str, problems: list[str], kind: type = int) -> int | float | None:
    try:
        number = kind(plain_value(value))
    except ValueError:
        problems.append(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        return None
    return number


def _value_of(overrides: list[str], key: str) -> str:
    return {o.lstrip("+").partition("=")[0].strip(): o.partition("=")[2] for o in overrides}.get(key, "")


def _kl_on(overrides: list[str]) -> bool:
    values = {o.lstrip("+").partition("=")[0].strip(): o.partition("=")[2] for o in overrides}
    ours = ("algorithm.use_kl_loss",)
    return any(plain_value(values.get(k, "false")) == "true" for k in (*KL_KEYS, *ours))


def translate(overrides: list[str]) -> Translation:
    """Read a command line's verl keys as ours in one pass (a `+` / `++` prefix is kept); every problem is listed.

    Arguments that are not `key=value` (Hydra flags) and keys that are not verl's pass through unchanged."""
    out: list[tuple[str, str]] = []  # (our key, override) of what we produced, in order
    plain: list[str] = []
    given: dict[str, str] = {}  # converted verl keys -> value
    t = Translation([])
    kl_on = _kl_on(overrides)
    for o in overrides:
        plus = o[: len(o) - len(o.lstrip("+"))]
        key, sep, value = o[len(plus) :].partition("=")
        key = key.strip()
        kind, detail = rule(key, kl_on) if sep and not key.startswith("~") else ("ours", None)
        if key in VERL_CONFIG_FLAGS and not is_verl_config_flag(o):
            kind = "ours"  # a config of ours (an example's)
        if kind == "ours":
            plain.append(o)
        else:
            _read(key, value, kind, detail, overrides, out, given, t)
    mine = {o.partition("=")[0].lstrip("+"): o.partition("=")[2] for o in plain} | {
        k: o.partition("=")[2] for k, o in out
    }
    t.converted = len(given)
    out += _convert(given, mine, t)
    out += _implied(overrides, mine, given, t)
    t.overrides = plain + _without_clashes(out, plain, t.problems)
    return t


def _read(
    key: str, value: str, kind: str, detail: Any, overrides: list[str], out: list, given: dict[str, str], t: Translation
) -> None:
    """One verl key of `kind` (rule()): what it sets goes to `out`, a key converted with others to `given`, what it
    says or refuses to `t`."""
    if kind in ("mapped", "pass"):
        if detail in ONE_OR_LIST and not value.strip().startswith("["):
            value = f"[{value}]"
        plus = "++" if detail.startswith(IN_DICT) else ""  # our schema has the key: verl's `+` would fail
        out.append((detail, f"{plus}{detail}={value}"))
        t.said("renamed", f"{key} -> {detail}" if kind == "mapped" else f"{key} (passed on)")
    elif kind == "choice":
        ours = detail.get(plain_value(value))
        if ours is None and key in NUMERIC and plain_value(value).lstrip("-").isdigit():
            ours = f"{NUMERIC[key]}={plain_value(value)}"
        if ours is None:
            t.problems.append(f"{key}={value} has no counterpart here; read values: {_choices(detail)}")
        elif ours:
            out.append((ours.partition("=")[0], ours))
            t.said("set", f"{key}={value} -> {ours}")
        else:
            t.said("already so, nothing to set", f"{key}={value}")
    elif kind == "same":
        accepted, why = detail
        if accepted and plain_value(value) not in accepted:
            t.problems.append(f"{key}={value} would change what verl does and has no counterpart here: {why}")
        else:
            t.said("so here anyway", f"{key}={value}")
    elif key == CRITIC_PATH and plain_value(value) != plain_value(_value_of(overrides, "actor_rollout_ref.model.path")):
        t.problems.append(f"{key}={value} differs from actor_rollout_ref.model.path: {detail}")
    elif kind == "noted" and key == "--config-name" and "megatron" in plain_value(value):
        out.append(("trainer.strategy", "trainer.strategy=megatron"))  # verl's megatron config: its strategy
        t.said("set", f"{key}={value} -> trainer.strategy=megatron")
    elif kind == "noted":
        t.said("already so, nothing to set", f"{key}={value}")
    elif kind == "unused":
        t.said("configures a part not in use", f"{key}={value}")
    elif kind == "converted":
        given[key] = value
    elif kind == "replaced":
        t.problems.append(f"{key}={value} has no one-to-one reading here; use {detail}")
    else:  # refused
        t.problems.append(f"{key}={value} is refused: {detail}")


def _implied(
    overrides: list[str], mine: dict[str, str], given: dict[str, str], t: Translation
) -> list[tuple[str, str]]:
    """What verl's line implies without saying it: steps counted by its epochs, the engine's context length."""
    out: list[tuple[str, str]] = []
    steps = ("trainer.total_steps", "trainer.total_training_steps", ROLLOUT_STEPS)
    if t.read and "trainer.total_epochs" in mine and not any(k in mine or k in given for k in steps):
        out.append(("trainer.total_steps", "trainer.total_steps=0"))
        t.notes.append("verl's line counts epochs and no steps: read as trainer.total_steps=0 (the epochs set it)")
    if "engine.max_model_len" not in mine and any(MAPPED.get(k) == "rollout.response_length" for k in _keys(overrides)):
        out.append(("engine.max_model_len", "engine.max_model_len=0"))
        t.notes.append(
            "verl derives the engine's context length from the prompt and response lengths: read as "
            "engine.max_model_len=0 (= data.max_prompt_length + rollout.response_length)"
        )
    return out


def _keys(overrides: list[str]) -> list[str]:
    return [o.lstrip("+").partition("=")[0].strip() for o in overrides]


def _choices(choices: dict[str, str]) -> str:
    return ", ".join(f"{v} (-> {ours})" for v, ours in choices.items())


def _without_clashes(produced: list[tuple[str, str]], plain: list[str], problems: list[str]) -> list[str]:
    """The produced overrides, less those whose key the command line also sets itself (the same value: dropped as a
    repeat; another value: a problem, since the line would mean two things)."""
    mine = {o.partition("=")[0].lstrip("+"): o.partition("=")[2] for o in plain}
    kept, seen = [], {}
    for key, override in produced:
        value = override.partition("=")[2]
        earlier = mine.get(key, seen.get(key))
        if earlier is None:
            seen[key] = value
            kept.append(override)
        elif plain_value(earlier) != plain_value(value):
            problems.append(f"{key} is set twice, to {earlier} and (from a verl key) to {value}; keep one")
    return kept


def _convert(given: dict[str, str], mine: dict[str, str], t: Translation) -> list[tuple[str, str]]:
    """The converted keys (CONVERTED) -> our overrides, the arithmetic in t.notes, what does not work out in
    t.problems."""
    from fully_async.config.sections import AsyncTrainingConfig

    out: list[tuple[str, str]] = []

    def put(key: str, value: int, why: str) -> None:
        out.append((key, f"{key}={value}"))
        t.notes.append(f"{why}: read as {key}={value}")

    if STALENESS in given:
        threshold = _number(STALENESS, given[STALENESS], t.problems, float)
        if threshold is not None and threshold < 0:
            t.problems.append(f"{STALENESS} must be >= 0, got {given[STALENESS]}")
        elif threshold is not None:
            put("async_training.max_staleness", math.ceil(threshold),
                f"verl's {STALENESS}={given[STALENESS]} (a production budget) -> ceil = a hard bound in versions per "
                "trajectory")  # fmt: skip
    groups = _batch_sizes(given, t, put)
    if groups is None:
        groups = int(mine.get("async_training.groups_per_step") or AsyncTrainingConfig().groups_per_step)
    if ROLLOUT_STEPS in given:
        samples = _number(ROLLOUT_STEPS, given[ROLLOUT_STEPS], t.problems)
        if samples is not None and samples >= 1:
            put("trainer.total_steps", math.ceil(samples / groups),
                f"verl's {ROLLOUT_STEPS}={samples} prompts / {groups} groups per step (rounded up)")  # fmt: skip
        elif samples is not None:
            t.problems.append(f"{ROLLOUT_STEPS} must be >= 1, got {samples}")
    if TEST_FREQ in given and "trainer.val_every" in mine:
        # the fully-async recipe validates every rollout.test_freq versions (read as trainer.val_every)
        t.said("configures a part not in use", f"{TEST_FREQ}={given[TEST_FREQ]}")
    elif TEST_FREQ in given:
        freq = _number(TEST_FREQ, given[TEST_FREQ], t.problems)
        sync = _number("async_training.sync_every", mine.get("async_training.sync_every")
                       or str(AsyncTrainingConfig().sync_every), t.problems)  # fmt: skip
        if freq is not None and sync is not None and sync >= 1:
            every = 0 if freq <= 0 else math.ceil(freq / sync)
            put("trainer.val_every", every,
                f"verl's {TEST_FREQ}={freq} trainer steps / {sync} steps per weight version (rounded up; <= 0 = "
                "never)")  # fmt: skip
    out += _reward_function(given, t)
    if ROLLOUT_NODES in given or ROLLOUT_GPUS in given:
        nodes = _number(ROLLOUT_NODES, given.get(ROLLOUT_NODES, "1"), t.problems)
        gpus = _number(ROLLOUT_GPUS, given.get(ROLLOUT_GPUS, "1"), t.problems)
        tp = _number("engine.tensor_parallel_size", mine.get("engine.tensor_parallel_size", "1"), t.problems)
        if None not in (nodes, gpus, tp):
            if nodes < 1 or gpus < 1 or tp < 1 or (nodes * gpus) % tp:
                t.problems.append(
                    f"{ROLLOUT_NODES}={nodes} x {ROLLOUT_GPUS}={gpus} rollout GPUs must be >= 1 and a multiple of "
                    f"the tensor-parallel size {tp} (one engine server per model replica)"
                )
            else:
                put("engine.num_servers", nodes * gpus // tp,
                    f"verl's {ROLLOUT_NODES}={nodes} x {ROLLOUT_GPUS}={gpus} rollout GPUs / tensor-parallel size {tp} "
                    "= one engine server per replica")  # fmt: skip
    return out


def _reward_function(given: dict[str, str], t: Translation) -> list[tuple[str, str]]:
    """verl's custom_reward_function.path (a file, relative to where the command runs) and .name (default
    compute_score) -> one reward source of that function, by absolute path (Ray workers run elsewhere)."""
    path = given.get(REWARD_FILE, "").strip().strip("'\"")
    name = given.get(REWARD_NAME, "compute_score").strip().strip("'\"") or "compute_score"
    if REWARD_NAME in given and path.lower() in ("", "null", "none"):
        t.problems.append(f"{REWARD_NAME}={given[REWARD_NAME]} needs {REWARD_FILE} (the file that defines it)")
        return []
    if path.lower() in ("", "null", "none"):
        return []
    kind = f"{os.path.abspath(os.path.expanduser(path))}:{name}"
    t.notes.append(f"verl's {REWARD_FILE}={path} and function {name}: read as reward.sources=[{{kind: {kind}}}]")
    return [("reward.sources", f"reward.sources=[{{kind:'{kind}'}}]")]


def _batch_sizes(given: dict[str, str], t: Translation, put) -> int | None:
    """verl's batch sizes -> async_training.groups_per_step and trainer.num_mini_batches; the groups per step, or None
    when the command line gives none. One verl prompt is one group here (rollout.n samples).

    The fully-async recipe sets data.train_batch_size=0 and takes require_batches x ppo_mini_batch_size prompts per
    trainer step, one optimizer step per mini-batch; verl's synchronous trainer takes train_batch_size prompts cut into
    mini-batches of ppo_mini_batch_size."""
    sizes = {k: _number(k, given[k], t.problems) for k in (TRAIN_BATCH, MINI_BATCH, REQUIRE_BATCHES) if k in given}
    if None in sizes.values():
        return None
    for key, size in sizes.items():
        if size < (0 if key == TRAIN_BATCH else 1):
            t.problems.append(f"{key} must be >= {0 if key == TRAIN_BATCH else 1}, got {size}")
            return None
    batch, mini, required = sizes.get(TRAIN_BATCH), sizes.get(MINI_BATCH), sizes.get(REQUIRE_BATCHES)
    if mini is None:
        if required is not None:
            t.problems.append(f"{REQUIRE_BATCHES}={required} needs {MINI_BATCH} (a trainer step is their product)")
        elif batch == 0:
            t.problems.append(
                f"{TRAIN_BATCH}=0 is the fully-async recipe's 'derive it': pass {MINI_BATCH} (and {REQUIRE_BATCHES}), "
                "or async_training.groups_per_step, for the prompts per trainer step"
            )
        elif batch is not None:
            put("async_training.groups_per_step", batch, f"verl's {TRAIN_BATCH}={batch} prompts per step")
            return batch
        return None
    if required is None and batch:  # verl's synchronous trainer: the batch cut into mini-batches
        if batch % mini:
            t.problems.append(f"{TRAIN_BATCH}={batch} must be a multiple of {MINI_BATCH}={mini}")
            return None
        put("async_training.groups_per_step", batch, f"verl's {TRAIN_BATCH}={batch} prompts per step")
        put("trainer.num_mini_batches", batch // mini,
            f"verl's {TRAIN_BATCH}={batch} / {MINI_BATCH}={mini} optimizer steps per pass")  # fmt: skip
        return batch
    required = required or 1
    if batch and batch != required * mini:
        t.problems.append(
            f"{TRAIN_BATCH}={batch} disagrees with {REQUIRE_BATCHES}={required} x {MINI_BATCH}={mini} = "
            f"{required * mini} prompts per step; set {TRAIN_BATCH}=0 as the recipe does"
        )
        return None
    if batch == 0:
        t.notes.append(f"verl key {TRAIN_BATCH}=0 is the recipe's 'derive it': the step's size comes from {MINI_BATCH}")
    put("async_training.groups_per_step", required * mini,
        f"verl's {REQUIRE_BATCHES}={required} x {MINI_BATCH}={mini} prompts per trainer step")  # fmt: skip
    put("trainer.num_mini_batches", required, f"verl's {REQUIRE_BATCHES}={required} mini-batches per step")
    return required * mini
