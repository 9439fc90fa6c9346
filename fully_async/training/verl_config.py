"""verl's config dataclasses built from ours: the policy engine (FSDP2 on CPU or GPUs, Megatron on GPUs), its policy
loss, and the forward-only reference and the critic derived from it. Pure translation: nothing here starts a rank."""

from __future__ import annotations

import dataclasses

from fully_async.config import AlgorithmConfig, ConfigError, TrainerConfig
from fully_async.config.sections.model import LoraConfig
from fully_async.multimodal.processor import is_vision_model
from fully_async.training import vision_tower

_NO_MODULE = "FullyAsyncNoSuchModule"


def engine_configs(
    trainer: TrainerConfig, algorithm: AlgorithmConfig, model_path: str, cpu: bool, lora: LoraConfig | None = None
):
    """verl config dataclasses for the policy: (TrainingWorkerConfig, actor config used by the loss).

    fsdp2 runs on CPU (float32, padded sequences, eager attention) and GPUs (bf16); megatron (GPU only) adds TP/PP/CP
    from the trainer config. Loss, dispatch and weight export are the same for both. With `lora` enabled, verl's
    FSDP engine wraps the policy in a PEFT LoRA model (its `lora_rank`, `lora_alpha`, `target_modules`): only the
    adapter trains."""
    from verl.workers import config as vc

    lora_on = _check_strategy(trainer, cpu, lora)
    budget = {
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": trainer.max_token_len_per_gpu,
        "infer_max_token_len_per_gpu": trainer.max_token_len_per_gpu,
    }
    schedule = {
        "lr": lora.lr if lora_on and lora.lr is not None else trainer.lr,
        "weight_decay": trainer.weight_decay,
        "clip_grad": trainer.grad_clip,
        "lr_warmup_steps": trainer.lr_warmup_steps,
        "total_training_steps": trainer.total_steps,
    }
    build = _megatron_engine if trainer.strategy == "megatron" else _fsdp_engine
    optim, actor_cls, placement = build(trainer, cpu, budget, schedule)
    actor = actor_cls(
        rollout_n=1,
        **_loss_configs(algorithm),
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=trainer.max_token_len_per_gpu,
        optim=optim,
        clip_ratio_low=algorithm.clip_ratio_low,
        clip_ratio_high=algorithm.clip_ratio_high,
        loss_agg_mode=algorithm.loss_agg_mode,
        entropy_coeff=algorithm.entropy_coeff,
        use_kl_loss=algorithm.use_kl_loss,
        kl_loss_coef=algorithm.kl_loss_coef,
        ppo_epochs=trainer.ppo_epochs,
        **placement,
    )
    twc = vc.TrainingWorkerConfig(
        model_type="language_model",
        model_config=_model_config(trainer, model_path, cpu, lora if lora_on else None),
        engine_config=actor.engine,
        optimizer_config=actor.optim,
        checkpoint_config=actor.checkpoint,
    )
    return twc, actor


def _check_strategy(trainer: TrainerConfig, cpu: bool, lora: LoraConfig | None) -> bool:
    """Refuse what the strategy cannot do here (ConfigError); whether the policy trains a LoRA adapter."""
    megatron = trainer.strategy == "megatron"
    if megatron and cpu:
        raise ConfigError("trainer.strategy=megatron needs GPUs (megatron-core has no CPU path); use fsdp2 on CPU")
    lora_on = lora is not None and lora.enabled
    if lora_on and megatron:
        raise ConfigError(
            f"model.lora.rank={lora.rank} is built for trainer.strategy=fsdp2 (megatron's LoRA is not wired); use "
            "trainer.strategy=fsdp2 or model.lora.rank=0"
        )
    return lora_on


def _model_config(trainer: TrainerConfig, model_path: str, cpu: bool, lora: LoraConfig | None):
    """verl's HFModelConfig of the policy (`lora`: the enabled adapter, or None)."""
    from verl.workers import config as vc

    return vc.HFModelConfig(
        path=str(model_path),
        load_tokenizer=False,
        # eager on CPU: no flash-attn; SDPA's CPU kernels differ from the engine's by more than the 1e-4 we promise.
        override_config={"attn_implementation": "eager"} if cpu else {},
        # Packing sequences (remove-padding) pays off with flash-attn's varlen kernels; on CPU attention runs over the
        # whole packed length (quadratic in the micro-batch, not in each sequence): 3-4x slower on the benchmark.
        use_remove_padding=not cpu,
        enable_gradient_checkpointing=not cpu
        if trainer.gradient_checkpointing is None
        else trainer.gradient_checkpointing,
        **(lora_fields(lora, is_vision_model(model_path)) if lora is not None else {}),
    )


def _megatron_engine(trainer: TrainerConfig, cpu: bool, budget: dict, schedule: dict):
    """(optimizer config, actor config class, the actor's engine fields) for megatron (GPUs, bf16, TP/PP/CP)."""
    from verl.workers import config as vc

    engine = vc.McoreEngineConfig(
        tensor_model_parallel_size=trainer.tensor_parallel_size,
        pipeline_model_parallel_size=trainer.pipeline_parallel_size,
        context_parallel_size=trainer.context_parallel_size,
        dtype="bfloat16",
        **budget,
    )
    optim = vc.McoreOptimizerConfig(lr_decay_style=trainer.lr_schedule, **schedule)
    return optim, vc.McoreActorConfig, {"megatron": engine}


def _fsdp_engine(trainer: TrainerConfig, cpu: bool, budget: dict, schedule: dict):
    """(optimizer config, actor config class, the actor's engine fields) for fsdp2 (float32 on CPU, bf16 on GPUs)."""
    from verl.workers import config as vc

    precision = "fp32" if cpu else "bf16"
    units = trainer.fsdp_units
    if units == "auto":
        units = "model" if cpu and trainer.nnodes * trainer.n_gpus_per_node == 1 else "layers"
    engine = vc.FSDPEngineConfig(
        # verl's FSDP2 wrapping makes every module whose class is listed (default: the model's _no_split_modules)
        # a unit; a name no module has leaves the model as the one unit (untied embeddings still get their own).
        # `disable` keeps verl's FSDP1 wrap-policy builder, which it runs for FSDP2 too, from rejecting that name.
        wrap_policy={"disable": True, "transformer_layer_cls_to_wrap": [_NO_MODULE]} if units == "model" else {},
        strategy="fsdp2",
        use_torch_compile=not cpu,
        model_dtype="fp32",
        mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        **budget,
    )
    optim = vc.FSDPOptimizerConfig(lr_scheduler_type=trainer.lr_schedule, **schedule)
    return optim, vc.FSDPActorConfig, {"strategy": "fsdp2", "fsdp_config": engine}


def lora_fields(lora: LoraConfig, vision: bool = False) -> dict:
    """HFModelConfig's LoRA fields (verl's FSDP engine); PEFT takes "all-linear" as a string, not in a list. The
    dropout goes to the ranks separately (verl builds its PEFT config without one; verl_worker.py). A vision-language
    model's (`vision`) tower never gets an adapter (vision_tower.LORA_EXCLUDE; for a text model PEFT would warn that
    it excluded nothing)."""
    modules = list(lora.target_modules)
    return {
        "lora_rank": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": "all-linear" if modules == ["all-linear"] else modules,
        **({"exclude_modules": vision_tower.LORA_EXCLUDE} if vision else {}),
    }


def without_lora(model_config):
    """The same model config with LoRA off: the reference (the base model itself, which a fresh adapter would only
    reproduce) and the critic (trained in full) of a LoRA run."""
    return dataclasses.replace(model_config, lora_rank=0)


_ACTOR_LOSS_ARGS = ("tau_pos", "tau_neg", "clip_ratio_c")
"""algorithm.policy_loss_args that are fields of verl's ActorConfig (the rest are PolicyLossConfig fields)."""


def _loss_configs(algorithm: AlgorithmConfig) -> dict:
    """ActorConfig keyword arguments selecting verl's policy loss `algorithm.policy_loss` with its settings. In bypass
    mode (algorithm.rollout_correction.bypass_mode) the vanilla loss becomes verl's bypass_mode loss, as verl's own
    trainer does (rollout_corr_helper.apply_bypass_mode); it reads its IS and rejection settings from
    policy_loss.rollout_correction: ours, key for key."""
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import PolicyLossConfig

    from fully_async.config.sections.algorithm import BYPASS_LOSSES

    args = algorithm.policy_loss_args
    loss_mode = algorithm.policy_loss
    if algorithm.bypass and loss_mode in BYPASS_LOSSES:
        loss_mode = "bypass_mode"
    policy_loss = PolicyLossConfig(
        loss_mode=loss_mode,
        rollout_correction=RolloutCorrectionConfig(**algorithm.rollout_correction.verl_fields()),
        **{k: v for k, v in args.items() if k not in _ACTOR_LOSS_ARGS},
    )
    return {"policy_loss": policy_loss, **{k: v for k, v in args.items() if k in _ACTOR_LOSS_ARGS}}


def critic_config(twc, trainer: TrainerConfig):
    """Engine config for the critic: the policy's model loaded as a value model (verl's `load_valuehead_model`: the
    LM head replaced by a one-output score head), the same engine and precision, its own AdamW at trainer.critic_lr
    (default: trainer.lr, not model.lora.lr). With LoRA on the policy, the critic still trains in full (a new score
    head has nothing to adapt from)."""
    from verl.workers.config import TrainingWorkerConfig

    optim = dataclasses.replace(twc.optimizer_config, lr=trainer.lr if trainer.critic_lr is None else trainer.critic_lr)
    return TrainingWorkerConfig(
        model_type="value_model",
        model_config=without_lora(twc.model_config),
        engine_config=dataclasses.replace(twc.engine_config),
        optimizer_config=optim,
        checkpoint_config=twc.checkpoint_config,
    )


def value_loss_config(trainer: TrainerConfig, algorithm: AlgorithmConfig):
    """verl's critic config as its `value_loss` reads it: the value clip and the loss aggregation."""
    from verl.workers.config import FSDPCriticConfig

    return FSDPCriticConfig(
        strategy="fsdp2",
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=trainer.max_token_len_per_gpu,
        cliprange_value=algorithm.value_clip,
        loss_agg_mode=algorithm.loss_agg_mode,
        ppo_epochs=trainer.ppo_epochs,
    )


def reference_config(twc):
    """Forward-only engine config for the reference model: same model and precision, no optimizer, no LoRA."""
    from verl.workers.config import TrainingWorkerConfig

    return TrainingWorkerConfig(
        model_type=twc.model_type,
        model_config=without_lora(twc.model_config),
        engine_config=dataclasses.replace(twc.engine_config, forward_only=True),
        optimizer_config=None,
        checkpoint_config=twc.checkpoint_config,
    )
