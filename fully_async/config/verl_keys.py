"""verl 0.9.1 command-line keys a verl user types first, and what they are here.

Two kinds (names checked against verl's `trainer/config/_generated_ppo_trainer.yaml`):
- MAPPED: the same quantity under another name. `expand_overrides` rewrites `verl.key=value` to `our.key=value` and
  says so once on stderr, so a verl script's command line runs unchanged where it can.
- REPLACED: a different unit or mechanism. The override is refused with a ConfigError giving the exact replacement.

Imports only the standard library.
"""

from __future__ import annotations

import sys

MAPPED: dict[str, str] = {
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.response_length": "rollout.response_length",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "engine.gpu_memory_utilization",
    "actor_rollout_ref.rollout.max_model_len": "engine.max_model_len",
    "actor_rollout_ref.rollout.enforce_eager": "engine.enforce_eager",
    "actor_rollout_ref.actor.optim.lr": "trainer.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "trainer.weight_decay",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "trainer.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "trainer.lr_schedule",
    "actor_rollout_ref.actor.optim.clip_grad": "trainer.grad_clip",
    "actor_rollout_ref.actor.grad_clip": "trainer.grad_clip",
    "actor_rollout_ref.actor.ppo_epochs": "trainer.ppo_epochs",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "trainer.max_token_len_per_gpu",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_ratio_high",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_loss_coef",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coeff",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_agg_mode",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "algorithm.policy_loss",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "trainer.gradient_checkpointing",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "critic.optim.lr": "trainer.critic_lr",
    "critic.cliprange_value": "algorithm.value_clip",
    "algorithm.rollout_correction.rollout_is": "algorithm.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_is_threshold",
    "data.max_response_length": "rollout.response_length",
    # One verl prompt of a training batch is one group here (rollout.n samples): prompts per step = groups per step.
    "data.train_batch_size": "async_training.groups_per_step",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.save_freq": "trainer.save_every",
    "trainer.project_name": "logger.project",
    "trainer.experiment_name": "logger.run_name",
    "trainer.logger": "logger.backends",
    "trainer.resume_from_path": "trainer.resume",
}
"""verl key -> our key with the same meaning and unit."""

REPLACED: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": "trainer.num_mini_batches=<data.train_batch_size / "
    "ppo_mini_batch_size> (optimizer steps per trainer step; the step's size is async_training.groups_per_step)",
    "actor_rollout_ref.rollout.name": "engine=vllm (or engine=sim); engines are config groups here",
    "actor_rollout_ref.actor.strategy": "trainer.strategy=fsdp2 (or megatron)",
    "trainer.total_epochs": "trainer.total_steps=<epochs x dataset rows / async_training.groups_per_step> "
    "(we count trainer steps)",
    "trainer.test_freq": "trainer.val_every=<test_freq / async_training.sync_every> (validation runs every this "
    "many weight versions, on the rollout engines)",
    "trainer.resume_mode": "trainer.resume=auto, trainer.resume=none or trainer.resume=<checkpoint path>",
    "custom_reward_function.path": "reward.sources=[{kind: package.module:function}] (a dotted import path; same "
    "compute_score(data_source, solution_str, ground_truth, extra_info) signature)",
    "custom_reward_function.name": "reward.sources=[{kind: package.module:function}] (the function is named in the "
    "dotted path)",
    "algorithm.use_kl_in_reward": "algorithm.use_kl_loss=true (the KL term is a loss here, not a reward penalty)",
    "algorithm.filter_groups.max_num_gen_batches": "nothing: a filtered group frees its staleness slot and admission "
    "keeps generating until async_training.groups_per_step varying groups are queued (algorithm.filter_groups)",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "engine.num_servers (one model replica per server; "
    "engines are not tensor-parallel here)",
}
"""verl key -> the exact replacement, where the meaning or unit differs."""

_SECTIONS = sorted({k.split(".")[0] for k in [*MAPPED, *REPLACED]} - {"algorithm", "data", "trainer"})


def verl_hint(key: str) -> str:
    """' (verl's key; here: ...)' for a known verl key, '' otherwise. Used in unknown-key messages."""
    if key in MAPPED:
        return f" (verl's key; here it is {MAPPED[key]})"
    if key in REPLACED:
        return f" (verl's key; here use {REPLACED[key]})"
    if key.split(".")[0] in _SECTIONS:
        return " (a verl section; its keys and ours are listed in docs/migration-from-verl.md)"
    return ""


def translate(overrides: list[str], announce: bool = True) -> list[str]:
    """Rewrite `verl.key=value` overrides of MAPPED keys to ours (a `+` / `++` prefix is kept); other overrides are
    returned unchanged (REPLACED keys are refused later by check_overrides with their replacement).

    `announce`: print one line per rewritten key on stderr, so the run's command line and config agree."""
    out = []
    for o in overrides:
        plus = len(o) - len(o.lstrip("+~"))
        key, sep, value = o[plus:].partition("=")
        ours = MAPPED.get(key.strip()) if sep else None
        if ours is None:
            out.append(o)
            continue
        out.append(f"{o[:plus]}{ours}={value}")
        if announce:
            print(f"fully_async: verl key {key.strip()} read as {ours}", file=sys.stderr)
    return out
