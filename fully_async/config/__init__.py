"""Typed, validated configuration.

`FullyAsyncConfig` is the whole run's config; Hydra composes it from the YAML groups beside this file (engine/,
trainer/, reward/, data/, model/, logger/) on top of the dataclass defaults, and `build_config` turns the composed
mapping into validated dataclasses. Imports neither torch nor ray.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fully_async.config.base import (
    KEY_HINTS,
    ConfigError,
    collect,
    defaults_node,
    field_docs,
    from_dict,
    origins,
    raise_problems,
    schema_node,
    set_from,
    suggest,
    to_dict,
    validate_tree,
    was_given,
    without_missing,
)
from fully_async.config.sections import (
    GROUP_ESTIMATORS,
    GUESS_LOOP,
    LOOKUP_LOOP,
    AdvancedConfig,
    AlgorithmConfig,
    AsyncTrainingConfig,
    DataConfig,
    DistillConfig,
    EngineConfig,
    EnvConfig,
    FilterGroupsConfig,
    JudgeConfig,
    LoggerConfig,
    LoraConfig,
    ModelConfig,
    MultiTurnConfig,
    PlacementConfig,
    RewardConfig,
    RewardLimitsConfig,
    RewardModelConfig,
    RewardSourceConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    SimEngineConfig,
    SimTrainerConfig,
    TinyModelConfig,
    TrainerConfig,
    distill_problems,
    read_moved_keys,
    uncorrected_problem,
)
from fully_async.config.sections.async_training import on_sync_problems
from fully_async.config.sections.model import lora_on_sim
from fully_async.config.tasks import TASK_GROUP, task_problems, with_task_option
from fully_async.config.verl_keys import translate as translate_verl_keys
from fully_async.config.verl_table import verl_hint

CONFIG_DIR = Path(__file__).resolve().parent
PRIMARY_CONFIG = "fully_async"
KEY_HINTS.append(verl_hint)  # unknown-key messages name the verl key a user may have meant

GROUPS = ("engine", "trainer", "reward", "data", "model", "logger", TASK_GROUP)

__all__ = [
    "AdvancedConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "RolloutCorrectionConfig",
    "CONFIG_DIR",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "EngineConfig",
    "EnvConfig",
    "FilterGroupsConfig",
    "FullyAsyncConfig",
    "GROUPS",
    "LoggerConfig",
    "LoraConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "PlacementConfig",
    "JudgeConfig",
    "RewardConfig",
    "RewardLimitsConfig",
    "RewardModelConfig",
    "RewardSourceConfig",
    "RolloutConfig",
    "SimEngineConfig",
    "SimTrainerConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "build_config",
    "check_overrides",
    "compose",
    "expand_overrides",
    "field_docs",
    "group_options",
    "to_dict",
    "to_yaml",
]


@dataclass
class FullyAsyncConfig:
    seed: int = 0
    """Run seed, mixed into data.seed (shuffle order) and model.tiny.seed (the tiny model's init); 0 leaves those
    seeds as they are. Engine sampling is not seeded."""

    def mixed_seed(self, section_seed: int) -> int:
        """The seed a section uses: its own when `seed` is 0, else a hash of both (so `seed=1` and `seed=2` runs
        differ in every seeded part without editing each section)."""
        if self.seed == 0:
            return section_seed
        digest = hashlib.sha256(f"{self.seed}:{section_seed}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    def agent_loop_path(self) -> str:
        """The AgentLoop class the rollouter runs: rollout.agent_loop (the built-in task's own loop when unset, set
        by __post_init__), or the rollout-function loop when rollout.rollout_fn is set."""
        return self.rollout.agent_loop_path()

    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Staleness bound, sync cadence, partial rollout, batch size in groups."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling: samples per prompt, concurrency, response length."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Inference engine servers."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Where Ray puts the engine servers and trainer ranks (GPUs or CPUs they reserve)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Training backend, steps, optimizer, checkpoints."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the decoupled PPO loss."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions and their failure policy."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: a teacher scores every sampled token (off by default; docs/distillation.md)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metric sinks."""
    advanced: AdvancedConfig = field(default_factory=AdvancedConfig)
    """Internal bounds, buffer sizes and test knobs a normal run never sets."""

    def __post_init__(self) -> None:
        read_moved_keys(self)
        self._task_loop()

    def _task_loop(self) -> None:
        """data.synthetic_task=guess or lookup (no data files, no rollout_fn) runs the task's own loop, unless
        rollout.agent_loop is set (to any loop, the default's included: an explicit key wins)."""
        task_loop = {"guess": GUESS_LOOP, "lookup": LOOKUP_LOOP}.get(self.data.synthetic_task)
        ro = self.rollout
        if task_loop and not self.data.train_files and not ro.rollout_fn and not was_given(ro, "agent_loop"):
            set_from(ro, "agent_loop", task_loop, f"data.synthetic_task={self.data.synthetic_task}")

    def validate(self) -> FullyAsyncConfig:
        """Check every section and the cross-section rules; raise one ConfigError naming every key at fault (the
        first problem of each section, then each cross-section rule broken). Returns self."""
        if self.engine.max_model_len == 0:  # derived: resolved here so every reader sees the number
            self.engine.max_model_len = self.data.max_prompt_length + self.rollout.response_length
        problems: list[str] = []
        collect(problems, validate_tree, self)
        for rule in self._cross_section_problems():
            problems.append(rule)
        raise_problems(problems)
        return self

    def _cross_section_problems(self) -> list[str]:
        out = []
        if self.algorithm.adv_estimator in GROUP_ESTIMATORS and self.rollout.n < 2:
            out.append(
                f"rollout.n must be >= 2 with algorithm.adv_estimator={self.algorithm.adv_estimator} "
                f"(a group baseline needs two samples), got {self.rollout.n}"
            )
        both_sim = self.engine.kind == "sim" and self.trainer.backend == "sim"
        if both_sim and self.engine.sim.time_scale != self.trainer.sim.time_scale:
            out.append(
                f"trainer.sim.time_scale must equal engine.sim.time_scale={self.engine.sim.time_scale:g} "
                f"(both clocks run at one speed), got {self.trainer.sim.time_scale:g}"
            )
        if self.reward.overlong_buffer > self.rollout.response_length:
            out.append(
                f"reward.overlong_buffer must be <= rollout.response_length = {self.rollout.response_length} (the "
                f"penalty ramps up over the last overlong_buffer tokens of the budget), got {self.reward.overlong_buffer}"
            )
        if self.async_training.weight_transport == "collective" and self.engine.kind != "vllm":
            out.append(
                "async_training.weight_transport=collective needs engine.kind=vllm (the weight receiver is a vLLM "
                f"worker extension); use disk or auto with engine.kind={self.engine.kind}"
            )
        longest = self.data.max_prompt_length + self.rollout.response_length
        if longest > self.engine.max_model_len:
            out.append(
                f"engine.max_model_len must be >= data.max_prompt_length + rollout.response_length = {longest}, "
                f"got {self.engine.max_model_len}"
            )
        if self.model.lora.enabled and self.trainer.backend == "sim":
            out.append(lora_on_sim(self.model.lora.rank))
        if self.model.lora.enabled and self.model.lora.sync == "adapter" and self.engine.kind == "sim":
            # Known before Ray starts; the device-dependent reasons are weights/lora.py adapter_sync_plan's.
            out.append("model.lora.sync=adapter cannot work with engine.kind=sim (it emulates full-weight syncs "
                       "only); use model.lora.sync=auto or merged")  # fmt: skip
        uncorrected = uncorrected_problem(self.algorithm.rollout_correction, self.async_training.max_staleness)
        if uncorrected:
            out.append(uncorrected)
        out += on_sync_problems(self.async_training, self.engine.kind)
        out += task_problems(self)
        out += distill_problems(self)
        return out

    def limits(self) -> dict[str, int]:
        """The effective limits the run enforces, printed at start."""
        at = self.async_training
        return {
            "staleness_bound_versions": at.max_staleness,
            "groups_per_step": at.groups_per_step,
            "groups_per_version": at.groups_per_version,
            "max_groups_ahead_of_trainer": (at.max_staleness + 1) * at.groups_per_version,
            "max_inflight_groups": min(
                math.ceil(self.rollout.max_concurrent / self.rollout.n), (at.max_staleness + 1) * at.groups_per_version
            ),
            "max_inflight_samples": self.rollout.max_concurrent,
            "queue_capacity_groups": at.effective_queue_capacity(),
        }


def build_config(data: Any) -> FullyAsyncConfig:
    """Composed mapping (dict or OmegaConf node; a `hydra` key is ignored) -> validated FullyAsyncConfig. A MISSING
    value ('???', register_defaults' mark of a key no YAML and no override set) is left to presets and defaults."""
    if not isinstance(data, dict):
        from omegaconf import OmegaConf

        data = OmegaConf.to_container(data, resolve=True)
    data = without_missing({k: v for k, v in data.items() if k != "hydra"})
    problems: list[str] = []
    cfg = from_dict(FullyAsyncConfig, data, problems=problems)
    collect(problems, cfg.validate)  # the other keys' problems too, with defaults in place of the ones refused above
    raise_problems(problems)
    return cfg


def group_options(group: str) -> list[str]:
    """Names of the shipped YAML options of a config group (engine/vllm.yaml -> 'vllm')."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


_LOGGER_LIST = re.compile(r"^logger=(\[.*\])$")
_TILDE_ITEM = re.compile(r"(^|[\[,])\s*(~[^,\]'\"]*)")


def _quote_tilde(override: str) -> str:
    """`key=~/x` and `key=[~/x,/y]` -> the `~` items quoted: Hydra's grammar refuses an unquoted `~` in a value, and
    the shell does not expand it after `data.train_files=` (not a variable name), so verl scripts' paths reach us as
    written. The key part (where `~key` deletes) is left alone."""
    key, sep, value = override.partition("=")
    if not sep or "~" not in value:
        return override
    return key + sep + _TILDE_ITEM.sub(lambda m: f"{m.group(1)}'{m.group(2).strip()}'", value)


def expand_overrides(overrides: list[str], problems: list[str] | None = None, announce: bool = True) -> list[str]:
    """`logger=[console,wandb]` (a list of sinks) -> `logger.backends=[console,wandb]`; `logger=wandb` still picks the
    shipped option logger/wandb.yaml. verl keys are read as ours (config/verl_table.py, config/verl_keys.py: renamed, converted or noted,
    one line each on stderr unless `announce` is false); `data.synthetic_task=X` also selects `task=X`
    (config/tasks.py); a `~` path is quoted for Hydra. Everything else is returned unchanged.

    The verl keys that cannot be read are dropped and their problems appended to `problems`, or raised together
    when no list is given."""
    t = translate_verl_keys(overrides)
    if announce:
        t.announce()
    if problems is None:
        raise_problems(t.problems)
    else:
        problems.extend(t.problems)
    out = [
        _LOGGER_LIST.sub(r"logger.backends=\1", o.strip()) if o.strip().startswith("logger=") else o
        for o in (_quote_tilde(o) for o in t.overrides)
    ]
    return with_task_option(out, group_options(TASK_GROUP))


def check_overrides(overrides: list[str], problems: list[str] | None = None) -> list[str]:
    """Reject unknown keys and group options in command-line overrides before Hydra sees them, all at once.

    Hydra's own messages name neither the valid keys nor the closest one; ours do. `hydra.*` keys and Hydra flags are
    left to Hydra. Raises one ConfigError listing `problems` (those found earlier, e.g. by expand_overrides) and every
    bad override; with `problems` given, appends instead and returns the good overrides (to validate the rest too)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found: list[str] = []
    good: list[str] = []
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    except Exception as e:  # Hydra's grammar error: say which argument, keep its message
        found.append(f"cannot parse overrides {overrides}: {e}")
        parsed = []
    for raw, ov in zip(overrides, parsed):
        problem = _override_problem(ov)
        if problem:
            found.append(problem)
        else:
            good.append(raw)
    if problems is None:
        raise_problems(found)
    else:
        problems.extend(found)
    return good


def _override_problem(ov: Any) -> str | None:
    key = ov.key_or_group
    if key == "hydra" or key.startswith("hydra."):
        return None
    if key in GROUPS and isinstance(ov.value(), str) and not ov.is_delete():
        options = group_options(key)
        if ov.value() not in options:
            return (
                f"{key}={ov.value()} is not a shipped option of the '{key}' group; "
                f"choose one of {options}{suggest(ov.value(), options)}"
            )
        return None
    _, err = schema_node(FullyAsyncConfig, key.split("."))
    if err:
        hint = verl_hint(key)
        return f"unknown config key '{key}'{hint}" if hint else err  # a verl key: its replacement, not a spelling
    return None


def register_defaults() -> None:
    """Store the dataclass defaults as an untyped node, so every key exists for overrides while type and range
    checks stay ours (they name the key and what is allowed; OmegaConf's do not). The keys a preset or an older key
    may set hold MISSING there (config/base.py `settable`): one still MISSING after composition was set by nobody."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="fully_async_defaults", node=defaults_node(FullyAsyncConfig()))


def compose(
    overrides: list[str] | None = None, config_dir: str | Path | None = None, config_name: str = PRIMARY_CONFIG
) -> FullyAsyncConfig:
    """Compose a config with overrides, as the runner does, and validate it (tests, notebooks, the runner's check
    before Hydra runs). Raises one ConfigError listing every problem of the command line: verl keys that cannot be
    read, unknown keys, and what validating the config composed from the other overrides finds.

    `config_dir`/`config_name` select another primary config (an example's), which lists `fully_async` in its
    defaults and `pkg://fully_async.config` in hydra.searchpath."""
    problems: list[str] = []
    overrides = check_overrides(expand_overrides(list(overrides or []), problems), problems)
    cfg = collect(problems, _compose, overrides, config_dir, config_name)
    raise_problems(problems)
    return cfg


def _compose(overrides: list[str], config_dir: str | Path | None, config_name: str) -> FullyAsyncConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_defaults()
    with initialize_config_dir(config_dir=str(config_dir or CONFIG_DIR), version_base=None):
        composed = hydra_compose(config_name=config_name, overrides=overrides)
    return build_config(composed)


_YAML_KEY = re.compile(r"^( *)([^\s:#\-'\"][^:]*):( |$)")


def to_yaml(cfg: FullyAsyncConfig) -> str:
    """The resolved config as YAML (what `--cfg job` prints), each key a preset, an older key or a built-in task set
    marked with a comment saying which; every other key is the YAML's, the command line's or the default."""
    import yaml

    marks, path, out = origins(cfg), [], []
    for line in yaml.safe_dump(to_dict(cfg), sort_keys=False, width=1 << 30).splitlines():
        m = _YAML_KEY.match(line)
        if m:
            path = path[: len(m.group(1)) // 2] + [m.group(2)]
            if (key := ".".join(path)) in marks:
                line += f"  # from {marks[key]}"
        out.append(line)
    return "\n".join(out) + "\n"


def describe(cls: type = FullyAsyncConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, docstring) for every leaf field, for generated docs and `--help`."""
    rows: list[tuple[str, str, Any, str]] = []
    default = cls()
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        key = prefix + f.name
        if dataclasses.is_dataclass(value):
            rows.extend(describe(type(value), key + "."))
        else:
            rows.append((key, str(f.type), value, docs.get(f.name, "")))
    return rows
