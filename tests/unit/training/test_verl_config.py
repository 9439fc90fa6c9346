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


def test_lora_reaches_verls_model_config_and_not_the_reference_or_critic(tmp_path):
    from fully_async.config import LoraConfig, TinyModelConfig
    from fully_async.models.tiny import build_tiny_model
    from fully_async.training.verl_config import critic_config, engine_configs, reference_config

    model = str(build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), cache_dir=tmp_path))
    twc, _ = engine_configs(TrainerConfig(), AlgorithmConfig(), model, cpu=True, lora=LoraConfig(rank=8, alpha=32))
    m = twc.model_config
    assert (m.lora_rank, m.lora_alpha, m.target_modules) == (8, 32, "all-linear")  # PEFT's string form
    picked = LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])
    assert engine_configs(TrainerConfig(), AlgorithmConfig(), model, True, picked)[0].model_config.target_modules == [
        "q_proj", "v_proj"
    ]  # fmt: skip
    assert reference_config(twc).model_config.lora_rank == 0  # the base model itself
    assert critic_config(twc, TrainerConfig()).model_config.lora_rank == 0  # a new score head trains in full
    assert twc.optimizer_config.lr == TrainerConfig().lr  # model.lora.lr null: trainer.lr
    fast, _ = engine_configs(TrainerConfig(lr=1e-3), AlgorithmConfig(), model, True, LoraConfig(rank=8, lr=3e-3))
    assert fast.optimizer_config.lr == 3e-3 and critic_config(fast, TrainerConfig(lr=1e-3)).optimizer_config.lr == 1e-3
    assert engine_configs(TrainerConfig(), AlgorithmConfig(), model, True, LoraConfig())[0].model_config.lora_rank == 0
    with pytest.raises(ConfigError, match="model.lora.rank=8 is built for trainer.strategy=fsdp2"):
        engine_configs(TrainerConfig(strategy="megatron"), AlgorithmConfig(), model, False, LoraConfig(rank=8))


def test_lora_with_the_simulated_trainer_is_a_config_error(tmp_path):
    from fully_async.config import LoraConfig, compose
    from fully_async.training import build_backend

    with pytest.raises(ConfigError, match="model.lora.rank must be 0 with trainer.backend=sim"):
        build_backend(TrainerConfig(backend="sim"), AlgorithmConfig(), tmp_path, lora=LoraConfig(rank=8))
    with pytest.raises(ConfigError, match="model.lora.rank must be 0 with trainer.backend=sim"):
        compose(["trainer=sim", "engine=sim", "model.lora.rank=8"])
    compose(["trainer=sim", "engine=sim", "model.lora.rank=0"])
