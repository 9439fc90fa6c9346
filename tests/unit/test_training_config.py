"""Trainer config fields the verl backend reads, and the backend factory's errors."""

from __future__ import annotations

import pytest

from fully_async.config import AlgorithmConfig, ConfigError, TrainerConfig


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("call_timeout_s", 0, "trainer.call_timeout_s"),
        ("weight_bucket_mb", 0, "trainer.weight_bucket_mb"),
        ("strategy", "megatron", "megatron"),
    ],
)
def test_invalid_trainer_fields_name_the_key(field, value, needle):
    cfg = TrainerConfig(**{field: value})
    with pytest.raises(ConfigError, match=needle):
        cfg.validate_section("trainer.")


def test_unknown_backend_is_a_config_error(tmp_path):
    from fully_async.training import build_backend

    cfg = TrainerConfig()
    object.__setattr__(cfg, "backend", "torchtitan")
    with pytest.raises(ConfigError, match="trainer.backend"):
        build_backend(cfg, AlgorithmConfig(), tmp_path)
