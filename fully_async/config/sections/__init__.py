"""Config sections, one module per section group, one dataclass per role.

Where to look: async_training.py (staleness, sync, step size), rollout.py (sampling, agent loops, multi-turn),
engine.py (inference servers, placement), model.py, trainer.py, algorithm.py (advantages, losses, dynamic sampling),
reward.py, data.py, logger.py, advanced.py (internal bounds, buffer sizes, test knobs). Each field carries a one-line docstring (read by `field_docs` for error messages and
the generated reference); each section's `validate_section(prefix)` raises ConfigError.

No torch or ray imports here: the runner validates config before any heavy import. This module only re-exports,
so `from fully_async.config.sections import X` works whichever module holds X (hence no F401).
"""

# ruff: noqa: F401

from fully_async.config.sections.advanced import STAGINGS, AdvancedConfig, read_moved_keys
from fully_async.config.sections.algorithm import (
    GROUP_ESTIMATORS,
    NEEDS_CRITIC,
    NEEDS_PROX,
    NEEDS_UNBUILT,
    POLICY_LOSS_ARGS,
    AlgorithmConfig,
    FilterGroupsConfig,
)
from fully_async.config.sections.async_training import AsyncTrainingConfig
from fully_async.config.sections.data import DataConfig
from fully_async.config.sections.distill import TEACHER_SOURCE, DistillConfig, TeacherConfig, distill_problems
from fully_async.config.sections.engine import EngineConfig, PlacementConfig, SimEngineConfig
from fully_async.config.sections.env import ON_EXHAUSTED, EnvConfig
from fully_async.config.sections.gateway import GATEWAY_LOOP, GatewayConfig
from fully_async.config.sections.logger import LOGGER_BACKENDS, LOGGER_PACKAGES, LoggerConfig
from fully_async.config.sections.model import LoraConfig, ModelConfig, TinyModelConfig
from fully_async.config.sections.reward import (
    FAILURE_POLICIES,
    GROUP_FN_NAME,
    JUDGE_FIELDS,
    REWARD_KINDS,
    JudgeConfig,
    RewardConfig,
    RewardLimitsConfig,
    RewardModelConfig,
    RewardSourceConfig,
)
from fully_async.config.sections.rollout import (
    DEFAULT_AGENT_LOOP,
    GUESS_LOOP,
    LOOKUP_LOOP,
    ROLLOUT_FN_LOOP,
    MultiTurnConfig,
    RolloutConfig,
)
from fully_async.config.sections.rollout_correction import PRESETS, RolloutCorrectionConfig, uncorrected_problem
from fully_async.config.sections.trainer import SimTrainerConfig, TrainerConfig
