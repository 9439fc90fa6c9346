"""Trainer config fields the verl backend reads, and the backend factory's errors."""

from __future__ import annotations

import pytest

from fully_async.config import AlgorithmConfig, ConfigError, TrainerConfig


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("call_timeout_s", 0, "trainer.call_timeout_s"),
        ("weight_bucket_mb", 0, "trainer.weight_bucket_mb"),
        ("tensor_parallel_size", 2, "trainer.tensor_parallel_size=2 needs trainer.strategy=megatron"),
        ("pipeline_parallel_size", 0, "trainer.pipeline_parallel_size"),
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


def test_model_parallel_sizes_must_divide_the_ranks():
    cfg = TrainerConfig(strategy="megatron", n_gpus_per_node=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="= 4 must divide the trainer's ranks"):
        cfg.validate_section("trainer.")
    TrainerConfig(strategy="megatron", nnodes=2, n_gpus_per_node=2, tensor_parallel_size=2).validate_section("t.")


def test_megatron_builds_verls_mcore_configs_and_refuses_cpu(tmp_path):
    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

    from fully_async.config import TinyModelConfig
    from fully_async.models.tiny import build_tiny_model
    from fully_async.training.verl_config import engine_configs as _engine_configs

    model = str(build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), cache_dir=tmp_path))
    trainer = TrainerConfig(
        strategy="megatron", n_gpus_per_node=8, tensor_parallel_size=4, pipeline_parallel_size=2, lr=2e-6,
        lr_schedule="cosine", lr_warmup_steps=5, total_steps=50, max_token_len_per_gpu=8192,
    )  # fmt: skip
    twc, actor = _engine_configs(trainer, AlgorithmConfig(entropy_coeff=0.01), model, cpu=False)
    engine, optim = twc.engine_config, twc.optimizer_config
    assert isinstance(engine, McoreEngineConfig) and isinstance(optim, McoreOptimizerConfig)
    assert (engine.tensor_model_parallel_size, engine.pipeline_model_parallel_size) == (4, 2)
    assert engine.dtype == "bfloat16" and engine.sequence_parallel  # TP > 1 keeps sequence parallelism
    assert engine.max_token_len_per_gpu == 8192 and engine.use_dynamic_bsz
    assert (optim.lr, optim.lr_decay_style, optim.lr_warmup_steps, optim.total_training_steps) == (
        2e-6, "cosine", 5, 50
    )  # fmt: skip
    assert actor.entropy_coeff == 0.01 and actor.engine is engine and twc.model_config.use_remove_padding
    with pytest.raises(ConfigError, match="needs GPUs"):
        _engine_configs(trainer, AlgorithmConfig(), model, cpu=True)


@pytest.mark.parametrize(
    ("units", "cpu", "ranks", "expect_layers"),
    [
        ("auto", True, 1, False),  # one CPU rank: nothing to shard, the model is one unit
        ("auto", True, 2, True),
        ("auto", False, 1, True),  # GPU: a full unsharded copy of a large model would not fit beside the shards
        ("layers", True, 1, True),
        ("model", False, 8, False),
    ],
)
def test_fsdp_units_choose_verls_wrap_targets(tmp_path, units, cpu, ranks, expect_layers):
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import _select_fsdp2_wrap_targets, get_fsdp_wrap_policy

    from fully_async.config import TinyModelConfig
    from fully_async.models.tiny import build_tiny_model
    from fully_async.training.verl_config import engine_configs as _engine_configs

    path = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), cache_dir=tmp_path)
    trainer = TrainerConfig(n_gpus_per_node=ranks, fsdp_units=units)
    twc, _ = _engine_configs(trainer, AlgorithmConfig(), str(path), cpu=cpu)
    model = AutoModelForCausalLM.from_pretrained(path)
    get_fsdp_wrap_policy(model, twc.engine_config.wrap_policy)  # verl builds it for FSDP2 too: must not reject ours
    # the class list apply_fsdp2 uses: the configured one, else the model's _no_split_modules
    classes = twc.engine_config.wrap_policy.get("transformer_layer_cls_to_wrap", model._no_split_modules)
    targets = {type(m).__name__ for m in _select_fsdp2_wrap_targets(model, classes)}
    layer = model.model.layers[0].__class__.__name__
    assert (layer in targets) == expect_layers
    assert {"Embedding", "Linear"} <= targets  # untied embed_tokens and lm_head are units either way
