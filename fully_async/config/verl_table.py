"""verl's command-line keys and what each is here: the one table every key of a command line goes through (`rule`).

Kinds (names checked against verl's `trainer/config/_generated_ppo_trainer.yaml`, the fully-async recipe's
`fully_async_ppo_trainer.yaml` and the scripts in tests/data/verl_scripts/):
- MAPPED: the same quantity under another name (`verl.key=value` -> `our.key=value`).
- CHOICES: a verl value that names one of our settings (`actor_rollout_ref.rollout.name=sglang` -> `engine=sglang`).
- SAME: a setting whose accepted values are what fully_async does anyway (`use_dynamic_bsz=True`); any other value
  would change what verl does and is refused with the reason.
- NOTED: any value needs nothing set here (true already, or a kernel/memory choice); `unused`: it configures a part
  not in use (the reference model's keys while no KL term is on, `algorithm.kl_ctrl.*`).
- CONVERTED: verl's units turned into ours by verl_keys.translate, the arithmetic printed.
- REPLACED: a different unit or mechanism with no one-to-one reading: refused with the exact replacement.
- PREFIXES: whole subtrees (noted, unused, refused, or passed on under our name).

`refusals()` lists every refusal the table can give; docs/migration-from-verl.md's list is generated from it.
Imports only the standard library.
"""

from __future__ import annotations

import re

MAPPED: dict[str, str] = {
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.response_length": "rollout.response_length",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "engine.gpu_memory_utilization",
    "actor_rollout_ref.rollout.max_model_len": "engine.max_model_len",
    "actor_rollout_ref.rollout.enforce_eager": "engine.enforce_eager",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "engine.tensor_parallel_size",
    # Engine options both engines take (engine.py's docstrings say how each spells them).
    "actor_rollout_ref.rollout.enable_chunked_prefill": "engine.enable_chunked_prefill",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "engine.max_num_batched_tokens",
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
    "actor_rollout_ref.model.lora_rank": "model.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "model.lora.alpha",
    "actor_rollout_ref.model.target_modules": "model.lora.target_modules",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "critic.optim.lr": "trainer.critic_lr",
    "critic.cliprange_value": "algorithm.value_clip",
    "data.max_response_length": "rollout.response_length",
    "trainer.total_training_steps": "trainer.total_steps",
    "rollout.total_epochs": "trainer.total_epochs",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "rollout.val.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "rollout.val.top_p",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "rollout.val.top_k",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "rollout.val.do_sample",
    "actor_rollout_ref.rollout.val_kwargs.n": "rollout.val.n",
    "trainer.project_name": "logger.project",
    "trainer.experiment_name": "logger.run_name",
    "trainer.logger": "logger.backends",
    "trainer.resume_from_path": "trainer.resume",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "rollout.multi_turn.tool_config_path",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "rollout.multi_turn.max_turns",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "rollout.multi_turn.max_parallel_calls",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_penalty",
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": "reward.overlong_buffer",
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": "reward.overlong_penalty",
    # verl's vanilla policy loss always applies the dual clip (a lower bound of clip_ratio_c x A on negative A)
    "actor_rollout_ref.actor.clip_ratio_c": "algorithm.policy_loss_args.clip_ratio_c",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "trainer.tensor_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "trainer.pipeline_parallel_size",
    "actor_rollout_ref.actor.megatron.context_parallel_size": "trainer.context_parallel_size",
    "trainer.default_local_dir": "hydra.run.dir",
    # The fully-async recipe's own keys (recipe/fully_async_policy/config/fully_async_ppo_trainer.yaml).
    "async_training.trigger_parameter_sync_step": "async_training.sync_every",
    # The recipe's rollouter validates every test_freq parameter versions: our val_every's unit.
    "rollout.test_freq": "trainer.val_every",
}
"""verl key -> our key with the same meaning and unit."""

ONE_OR_LIST = {"model.lora.target_modules", "logger.backends"}
"""Our list keys whose verl key also takes one bare string (target_modules=all-linear): read as a list of it."""

IN_DICT = ("algorithm.policy_loss_args.",)
"""Our keys inside a free-form dict: Hydra adds them only with `++` (add or override)."""

_PROX = {"true": "algorithm.recompute_prox=false", "false": "algorithm.recompute_prox=true"}
"""Training on the engine's log-probs as pi_old (verl's bypass) = not recomputing pi_prox here."""
_TOOL_LOOP = "rollout.agent_loop=fully_async.agents.tool:ToolAgentLoop"
_SINGLE_LOOP = "rollout.agent_loop=fully_async.agents.single_turn:SingleTurnAgentLoop"
CHOICES: dict[str, dict[str, str]] = {
    "actor_rollout_ref.rollout.name": {"vllm": "engine=vllm", "sglang": "engine=sglang"},
    # verl's fsdp (FSDP1) computes the same update as fsdp2; our trainer shards with FSDP2.
    "actor_rollout_ref.actor.strategy": {
        "fsdp2": "trainer.strategy=fsdp2",
        "fsdp": "trainer.strategy=fsdp2",
        "megatron": "trainer.strategy=megatron",
    },
    "actor_rollout_ref.rollout.checkpoint_engine.backend": {
        "nccl": "async_training.weight_transport=collective",
        "naive": "async_training.weight_transport=disk",
    },
    "actor_rollout_ref.actor.use_rollout_log_probs": _PROX,
    "actor_rollout_ref.rollout.multi_turn.enable": {"true": _TOOL_LOOP, "false": _SINGLE_LOOP},
    "actor_rollout_ref.rollout.agent.default_agent_loop": {"tool_agent": _TOOL_LOOP, "single_turn_agent": _SINGLE_LOOP},
    # verl's fully-async trainer: the engine's log-probs are the behaviour policy's (ours always are); whether pi_prox
    # is recomputed is its compute_prox_log_prob.
    "async_training.use_rollout_log_probs": {"true": "", "false": "algorithm.recompute_prox=true"},
    "async_training.compute_prox_log_prob": {
        "true": "algorithm.recompute_prox=true",
        "false": "algorithm.recompute_prox=false",
    },
    "trainer.save_freq": {"-1": "trainer.save_every=0"},
    "trainer.resume_mode": {"auto": "trainer.resume=auto", "disable": "trainer.resume=none", "resume_path": ""},
}
"""verl key -> {verl value: our override ('' = nothing to set)}; another value is refused, naming the ones read,
unless the key is also in NUMERIC (then any other integer is passed on as the value of NUMERIC's key)."""

NUMERIC: dict[str, str] = {"trainer.save_freq": "trainer.save_every"}
"""CHOICES keys whose other values are numbers passed on 1:1 (save_freq=20 -> save_every=20; -1 = never -> 0)."""

_DYNAMIC = "dynamic batch size is always on here (micro-batches are cut at trainer.max_token_len_per_gpu tokens)"
_MICRO = "a micro-batch size is unused with dynamic batch size (verl ignores it too when use_dynamic_bsz=True)"
_OFFLOAD = (
    "the trainer keeps parameters and optimizer state on its devices: verl's FSDP CPU offload is not wired into our "
    "training backend (untested here without GPUs), so only false is accepted"
)
SAME: dict[str, tuple[tuple[str, ...], str]] = {
    "data.gen_batch_size": (("1",), "prompts are admitted one group at a time"),
    "data.return_raw_chat": (("true",), "prompts stay chat messages until the agent loop renders them"),
    "data.truncation": (
        ("error", "left", "right", "middle"),
        "prompts are never cut here: a prompt over data.max_prompt_length is an error naming its file and row",
    ),
    "actor_rollout_ref.actor.use_dynamic_bsz": (("true",), _DYNAMIC),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": (("true",), _DYNAMIC),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": (("true",), _DYNAMIC),
    "critic.use_dynamic_bsz": (("true",), _DYNAMIC),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ((), _MICRO),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ((), _MICRO),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ((), _MICRO),
    "critic.ppo_micro_batch_size_per_gpu": ((), _MICRO),
    "actor_rollout_ref.rollout.calculate_log_probs": (("true",), "behaviour log-probs always come from the engine"),
    "actor_rollout_ref.rollout.mode": (("async",), "engines are always asynchronous HTTP servers"),
    "actor_rollout_ref.hybrid_engine": (("false",), "the trainer and the engines are always separate processes"),
    "algorithm.use_kl_in_reward": (
        ("false",),
        "no KL penalty in the reward; a KL term is a loss here (algorithm.use_kl_loss=true)",
    ),
    "critic.strategy": (("fsdp2", "fsdp"), "the critic trains with the policy's trainer.strategy"),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": (("1",), "no Ulysses sequence parallelism"),
    "trainer.critic_warmup": (("0",), "the policy trains from the first step"),
    "reward_model.overlong_buffer.enable": (
        ("true",),
        "the overlong penalty is on when reward.overlong_buffer > 0 (reward_model.overlong_buffer.len); leave len out "
        "for off",
    ),
    "actor_rollout_ref.actor.fsdp_config.param_offload": (("false",), _OFFLOAD),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": (("false",), _OFFLOAD),
    "actor_rollout_ref.ref.fsdp_config.param_offload": (("false",), _OFFLOAD),
    "critic.model.fsdp_config.param_offload": (("false",), _OFFLOAD),
    "critic.model.fsdp_config.optimizer_offload": (("false",), _OFFLOAD),
    "actor_rollout_ref.actor.kl_loss_type": (
        ("low_var_kl",),
        "the KL loss (algorithm.use_kl_loss=true) is verl's low_var_kl estimator",
    ),
    "reward_model.reward_manager": (
        ("naive", "dapo"),
        "one score per response from the reward sources; dapo's overlong shaping is reward.overlong_buffer "
        "(its reward_kwargs.overlong_buffer_cfg keys are read as ours)",
    ),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": (
        ("true",),
        "the overlong penalty is on when reward.overlong_buffer > 0 (overlong_buffer_cfg.len); leave len out for off",
    ),
    "actor_rollout_ref.actor.megatron.use_dist_checkpointing": (("false",), "checkpoints are verl's per-rank files"),
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": (
        ("null", "none", "1"),
        "no interleaved (virtual) pipeline stages",
    ),
    "actor_rollout_ref.actor.megatron.param_offload": (("false",), _OFFLOAD),
    "actor_rollout_ref.actor.megatron.grad_offload": (("false",), _OFFLOAD),
    "actor_rollout_ref.actor.megatron.optimizer_offload": (("false",), _OFFLOAD),
    "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload": (("false",), _OFFLOAD),
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": (
        ("1",),
        "no expert parallelism: each trainer rank holds every expert of an MoE layer",
    ),
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": (("1", "null", "none"), "no expert parallelism"),
    "actor_rollout_ref.actor.optim.lr_decay_style": (
        ("constant",),
        "the learning rate after warm-up follows trainer.lr_schedule (constant or cosine, read from lr_scheduler_type)",
    ),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (
        ("1",),
        "no Ulysses sequence parallelism: every trainer rank holds whole sequences (long contexts: "
        "trainer.strategy=megatron with trainer.context_parallel_size)",
    ),
}
"""verl key -> (the values that are our behaviour anyway, lower case; () = any value, why). Accepted with one note
line; another value is refused naming the key, the value and why."""

_PACKED = "sequences are always packed without padding here (any value computes the same loss)"
_LOGPROB_BUDGET = "log-probs are computed in the trainer's micro-batches of trainer.max_token_len_per_gpu tokens"
_KERNELS = "a GPU kernel or memory choice of verl's: the model computes the same"
NOTED: dict[str, str] = {
    "actor_rollout_ref.model.use_remove_padding": _PACKED,
    "critic.model.use_remove_padding": _PACKED,
    "actor_rollout_ref.model.use_fused_kernels": _KERNELS,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": _LOGPROB_BUDGET,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": _LOGPROB_BUDGET,
    "actor_rollout_ref.actor.optim.lr_decay_steps": "the schedule runs over trainer.total_steps (trainer.lr_schedule)",
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": "one tool response follows each assistant turn, so "
    "rollout.multi_turn.max_turns bounds both",
    "critic.ppo_max_token_len_per_gpu": "the critic's micro-batches are cut at trainer.max_token_len_per_gpu tokens",
    "critic.model.path": "the critic starts from the policy's model.path (a value head on it); another model is not "
    "supported",
    "critic.model.enable_gradient_checkpointing": "trainer.gradient_checkpointing holds for the policy and the critic",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": "the trainer shards over all its ranks; a smaller sharding group "
    "(verl's hybrid sharding) changes memory and communication, not the update",
    "data.filter_overlong_prompts": "a prompt over data.max_prompt_length is an error naming its file and row before "
    "the run starts, so no over-long prompt is ever trained",
    "trainer.log_val_generations": "validation logs val/reward_mean, not generations",
    "trainer.use_legacy_worker_impl": "one training worker here",
    "actor_rollout_ref.nccl_timeout": "trainer.call_timeout_s bounds a trainer call",
    "actor_rollout_ref.actor.checkpoint.save_contents": "a checkpoint always holds model, optimizer and extra state",
    "actor_rollout_ref.rollout.load_format": "the engine servers load the model from model.path and every weight "
    "version from the trainer",
    "actor_rollout_ref.rollout.layered_summon": "a memory option of verl's colocated LoRA weight gather; our engines "
    "are separate processes",
    "actor_rollout_ref.rollout.free_cache_engine": "engines are separate processes that keep their cache",
    "actor_rollout_ref.rollout.enable_sleep_mode": "engines are separate processes that never sleep",
    "actor_rollout_ref.rollout.multi_turn.format": "tool calls are parsed in the hermes format",
    "actor_rollout_ref.actor.megatron.use_mbridge": "the Megatron model is built by verl's bridge as verl does",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": "the overlong penalty is always in the trajectory records",
    "reward_model.reward_kwargs.max_resp_len": "the overlong buffer counts back from rollout.response_length",
}
"""verl key -> why any value needs nothing set here: it is true already, or it tunes a part not in use."""

PREFIXES: dict[str, tuple[str, str]] = {
    "algorithm.kl_ctrl.": ("unused", "the KL penalty in the reward is off here (algorithm.use_kl_in_reward=False)"),
    "actor_rollout_ref.actor.megatron.override_transformer_config.": ("noted", _KERNELS),
    "actor_rollout_ref.actor.optim.override_optimizer_config.": ("noted", _KERNELS),
    "actor_rollout_ref.ref.megatron.": ("noted", "the reference model is sharded as the policy is (trainer.*)"),
    "actor_rollout_ref.model.override_config.": (
        "refused",
        "the engine servers read the model's own config.json: edit it there (e.g. max_position_embeddings)",
    ),
    "actor_rollout_ref.rollout.engine_kwargs.": ("refused", "engine options go in engine.extra_args"),
    "data.custom_cls.": ("refused", "rows come from data.train_files' columns; a dataset class is not loaded"),
    "algorithm.rollout_correction.": ("pass", "algorithm.rollout_correction."),
}
"""verl key prefix -> (what happens to every key under it, why or our prefix) for keys no exact rule names:
noted (nothing to set), unused (configures a part not in use), refused (the reason), pass (the same name under our
prefix)."""

VERL_CONFIG_FLAGS = {
    "--config-path": "verl's recipe config directory: fully_async composes its own config (dropped)",
    "--config-name": "verl's recipe config file: fully_async composes its own config (dropped)",
}
"""Hydra flags of verl's scripts written `--flag=value`, which name verl's own config files."""


def is_verl_config_flag(arg: str) -> bool:
    """`--config-path=config` / `--config-name=<verl's *_trainer config>` as verl's scripts write them."""
    key, sep, value = arg.partition("=")
    return (
        bool(sep)
        and key in VERL_CONFIG_FLAGS
        and bool(re.fullmatch(r"config|\w*_trainer(\.yaml)?", plain_value(value)))
    )


REF = "actor_rollout_ref.ref."
"""The reference model's keys: configure a part not in use unless a KL term is on (then their exact rules hold)."""
KL_KEYS = ("actor_rollout_ref.actor.use_kl_loss", "algorithm.use_kl_in_reward")

REPLACED: dict[str, str] = {
    "algorithm.filter_groups.max_num_gen_batches": "nothing: a filtered group frees its staleness slot and admission "
    "keeps generating until async_training.groups_per_step varying groups are queued (algorithm.filter_groups)",
    "async_training.use_trainer_do_validate": "trainer.val_every (validation runs on the rollout engines)",
    "async_training.use_dynamic_resource_scheduling": "nothing: trainer GPUs do not join rollout",
    "async_training.concurrent_samples_per_replica": "rollout.max_concurrent=<concurrent_samples_per_replica x "
    "engine servers> (ours is the total over all servers)",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": "rollout.multi_turn.max_tool_response_tokens "
    "(ours cuts tool responses in tokens, not characters)",
}
"""verl key -> the exact replacement, where the meaning or unit differs."""

STALENESS = "async_training.staleness_threshold"
TRAIN_BATCH = "data.train_batch_size"
MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"
REQUIRE_BATCHES = "async_training.require_batches"
ROLLOUT_NODES, ROLLOUT_GPUS = "rollout.nnodes", "rollout.n_gpus_per_node"
ROLLOUT_STEPS = "rollout.total_rollout_steps"
TEST_FREQ = "trainer.test_freq"
REWARD_FILE, REWARD_NAME = "custom_reward_function.path", "custom_reward_function.name"
CONVERTED = (STALENESS, TRAIN_BATCH, MINI_BATCH, REQUIRE_BATCHES, ROLLOUT_NODES, ROLLOUT_GPUS, ROLLOUT_STEPS, TEST_FREQ,
             REWARD_FILE, REWARD_NAME)  # fmt: skip
"""verl keys whose value is converted to our unit (`translate`), with the arithmetic printed."""

_OURS = {"algorithm", "async_training", "data", "rollout", "trainer"}
"""Top-level sections verl and we share: an unknown key there gets the nearest of ours, not the migration table."""
_SECTIONS = sorted({k.split(".")[0] for k in [*MAPPED, *REPLACED, *SAME, *CHOICES, *CONVERTED, *NOTED]} - _OURS)


def verl_hint(key: str) -> str:
    """' (verl's key; here: ...)' for a known verl key, '' otherwise. Used in unknown-key messages."""
    if key in MAPPED:
        return f" (verl's key; here it is {MAPPED[key]})"
    if key in REPLACED:
        return f" (verl's key; here use {REPLACED[key]})"
    if key in SAME or key in CHOICES or key in CONVERTED or key in NOTED:
        return " (verl's key; read on the command line, see docs/migration-from-verl.md)"
    if key.split(".")[0] in _SECTIONS:
        return " (a verl section; its keys and ours are listed in docs/migration-from-verl.md)"
    return ""


def rule(key: str, kl_on: bool = False) -> tuple[str, object]:
    """What a verl key is here, the one lookup every key of a command line goes through: (kind, detail).

    Kinds: mapped (detail: our key), choice ({verl value: our override}), same ((accepted values, why)), noted (why),
    unused (why: it configures a part not in use),
    converted (None: `_convert` reads it), replaced (the replacement), refused (why), pass (our key: the same name
    under our prefix), ours (not a verl key we know: left to the key check). `kl_on`: a KL term is on, so the reference
    model's keys (REF) configure a part in use and their exact rules hold; otherwise they are noted as not in use."""
    if key in VERL_CONFIG_FLAGS:
        return "noted", VERL_CONFIG_FLAGS[key]
    if key.startswith(REF) and not kl_on:
        return (
            "unused",
            "no reference model is in use: the KL terms are off (actor_rollout_ref.actor.use_kl_loss=False)",
        )
    for kind, table in (("mapped", MAPPED), ("choice", CHOICES), ("same", SAME), ("noted", NOTED),
                        ("replaced", REPLACED)):  # fmt: skip
        if key in table:
            return kind, table[key]
    if key in CONVERTED:
        return "converted", None
    for prefix, (kind, detail) in PREFIXES.items():
        if key.startswith(prefix):
            return kind, detail + key.removeprefix(prefix) if kind == "pass" else detail
    return "ours", None


def plain_value(value: str) -> str:
    """A command-line value as the user meant it: outer quotes off, case folded (True/true/TRUE)."""
    return value.strip().strip("'\"").lower()


CRITIC_PATH = "critic.model.path"


def refusals() -> list[tuple[str, str, str]]:
    """(verl key or prefix*, the values refused, why or what to use instead): every refusal the table can give,
    for docs/migration-from-verl.md (`python -m fully_async.config.docs --verl-refusals` rewrites its block)."""
    rows = [(k, "any", f"use {v}") for k, v in REPLACED.items()]
    rows += [(k, f"other than {', '.join(values)}", why) for k, (values, why) in SAME.items() if values]
    rows += [(k, f"other than {', '.join(c)}", "no counterpart here") for k, c in CHOICES.items() if k not in NUMERIC]
    rows += [(CRITIC_PATH, "other than actor_rollout_ref.model.path", NOTED[CRITIC_PATH])]
    rows += [(p + "*", "any", why) for p, (kind, why) in PREFIXES.items() if kind == "refused"]
    return sorted(rows)


def refusals_markdown() -> str:
    lines = ["| verl key | refused values | why / instead |", "|---|---|---|"]
    lines += [f"| `{k}` | {values} | {why} |" for k, values, why in refusals()]
    return "\n".join(lines)
