"""Config composition and validation: every shipped config validates; bad configs name the key."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fully_async.config import (
    CONFIG_DIR,
    GROUPS,
    ConfigError,
    FullyAsyncConfig,
    build_config,
    compose,
    describe,
    field_docs,
    group_options,
)

REPO = Path(__file__).resolve().parents[3]


def shipped_group_options():
    return [(g, o) for g in GROUPS for o in group_options(g)]


@pytest.mark.parametrize(("group", "option"), shipped_group_options())
def test_every_shipped_group_option_composes_and_validates(group, option):
    cfg = compose([f"{group}={option}"])
    assert isinstance(cfg, FullyAsyncConfig)


def test_every_group_has_an_option_and_each_yaml_opens_with_its_command():
    for group in GROUPS:
        assert group_options(group), f"config group {group}/ ships no option"
        for path in (CONFIG_DIR / group).glob("*.yaml"):
            assert path.read_text().startswith("#"), f"{path} must open with a comment naming the command that uses it"


def example_configs():
    return sorted((REPO / "examples").glob("**/config.yaml"))


@pytest.mark.parametrize("path", example_configs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_config_validates(path):
    cfg = compose(config_dir=path.parent, config_name=path.stem)
    data = yaml.safe_load(path.read_text())

    # The example's own values win over the shipped defaults (nested sections such as engine.sim key by key).
    def check(node, values: dict, where: str) -> None:
        for key, value in values.items():
            actual = getattr(node, key)
            if isinstance(value, dict) and dataclasses.is_dataclass(actual):
                check(actual, value, f"{where}{key}.")
            elif isinstance(value, list) and actual and dataclasses.is_dataclass(actual[0]):  # e.g. reward.sources
                assert len(actual) == len(value), f"{path}: {where}{key}"
                for i, (a, v) in enumerate(zip(actual, value)):
                    check(a, v, f"{where}{key}[{i}].")
            elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                # Lists of paths are expanded (~) on validation.
                assert actual == [os.path.expanduser(v) for v in value], f"{path}: {where}{key}"
            else:
                assert actual == value, f"{path}: {where}{key}"

    check(cfg, {k: v for k, v in data.items() if k not in ("defaults", "hydra")}, "")


BAD = [
    (["async_training.max_staleness=-1"], "async_training.max_staleness", ">= 0"),
    (["rollout.n=0"], "rollout.n", ">= 1"),
    (["rollout.n=1"], "rollout.n", "group baseline"),  # grpo needs two samples per group
    (["rollout.nn=4"], "rollout.nn", "did you mean 'rollout.n'"),
    (["+trainer.total_stpes=4"], "trainer.total_stpes", "did you mean 'trainer.total_steps'"),
    (["rollout.n=four"], "rollout.n", "integer"),
    (["async_training.partial_rollout=maybe"], "async_training.partial_rollout", "true or false"),
    (["async_training.sync_every=0"], "async_training.sync_every", ">= 1"),
    (["async_training.weight_transport=nfs"], "async_training.weight_transport", "one of ['disk', 'collective'"),
    (["engine=sim", "async_training.weight_transport=collective"], "weight_transport=collective", "engine.kind=vllm"),
    (["advanced.bucket_mb=0"], "advanced.bucket_mb", ">= 1"),
    (["async_training.sync_mode=later"], "async_training.sync_mode", "one of ['blocking', 'background']"),
    (["advanced.staging=host"], "advanced.staging", "one of ['device', 'pinned']"),
    (["rollout.temperature=0"], "rollout.temperature", "> 0"),
    (["rollout.top_p=1.5"], "rollout.top_p", "(0, 1]"),
    (["engine.dtype=fp8"], "engine.dtype", "one of"),
    (["engine.control_deadline_s=0"], "engine.control_deadline_s", "> 0"),
    (["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator", "did you mean 'grpo'"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator", "registers: ['gae', 'grpo', "),
    (["algorithm.policy_loss=ppo"], "algorithm.policy_loss", "registers: ['vanilla', "),
    (["algorithm.adv_estimator=gae", "algorithm.lam=1.5"], "algorithm.lam", "in [0, 1]"),
    (["algorithm.adv_estimator=gae", "algorithm.value_clip=0"], "algorithm.value_clip", "> 0"),
    (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator=remax", "greedy baseline rollout"),
    (
        ["algorithm.adv_estimator=optimal_token_baseline", "algorithm.rollout_correction.preset=bypass_pg_is"],
        "bypass_mode=false",
        "pi_prox",
    ),
    (["algorithm.adv_estimator=gdpo"], "algorithm.gdpo_reward_keys", "non-empty list"),
    (
        ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
        "algorithm.gdpo_reward_weights",
        "one weight per",
    ),
    (["algorithm.policy_loss=bypass_mode"], "algorithm.policy_loss=bypass_mode", "bypass_mode=true"),
    (["algorithm.policy_loss=dro"], "algorithm.policy_loss_args.dro_beta", "quadratic"),
    (["+algorithm.policy_loss_args.dro_bta=0.1"], "algorithm.policy_loss_args", "did you mean 'dro_beta'"),
    (["+algorithm.policy_loss_args.dro_beta=x"], "algorithm.policy_loss_args.dro_beta", "a number"),
    (["algorithm.adv_estimator=rloo", "rollout.n=1"], "rollout.n", "group baseline"),
    (["engine=vlm"], "engine=vlm", "did you mean 'vllm'"),
    (["logger.backends=[console,wandbb]"], "logger.backends[1]", "did you mean 'wandb'"),
    (["reward.sources=[{kind: not a path}]"], "reward.sources[0].kind", "dotted path"),
    (["reward.sources=[{kind: rule},{kind: rule}]"], "reward.sources[1].name", "already the name"),
    (["reward=judge", "reward.sources.1.limits.rpm=-1"], "reward.sources[1].limits.rpm", ">= 0"),
    (["reward=judge", "reward.sources.1.on_failure=ignore"], "reward.sources[1].on_failure", "one of"),
    (
        ["reward=judge", "+reward.sources.1.judge.prompt_template='Q {answer}'"],
        "prompt_template",
        "unknown placeholders",
    ),
    (["reward.sources=[{kind: judge}]"], "reward.sources[0].judge.base_url", "must be set"),
    (["logger=[console,tensorbord]"], "logger.backends[1]", "did you mean 'tensorboard'"),
    (["logger=[jsonl,jsonl]"], "logger.backends", "twice"),
    (["rollout.response_length=1000"], "engine.max_model_len", "data.max_prompt_length + rollout.response_length"),
    (["model.tiny.hidden_size=130"], "model.tiny.hidden_size", "multiple of num_heads"),
    (["trainer.total_steps=0"], "trainer.total_steps", ">= 1"),
    (["rollout.max_concurrent=8", "rollout.start_concurrent=9"], "rollout.start_concurrent", "max_concurrent = 8"),
]


@pytest.mark.parametrize(("overrides", "key", "hint"), BAD, ids=lambda x: x if isinstance(x, str) else None)
def test_bad_config_raises_config_error_naming_the_key(overrides, key, hint):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert key in str(err.value)
    assert hint in str(err.value)


def test_logger_list_selects_sinks_and_a_shipped_option_still_composes():
    assert compose(["logger=[console,jsonl,wandb,tensorboard]"]).logger.backends == [
        "console", "jsonl", "wandb", "tensorboard"
    ]  # fmt: skip
    assert compose(["logger=[tensorboard]"]).logger.backends == ["tensorboard"]
    assert compose(["logger=wandb", "logger.project=p"]).logger.backends == ["console", "jsonl", "wandb"]
    assert compose([]).logger.backends == ["console", "jsonl"]


def test_unknown_key_in_a_mapping_is_rejected_with_suggestion():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'async_training.max_stalenes' \(did you mean 'max_staleness'"
    ):
        build_config({"async_training": {"max_stalenes": 2}})


def test_limits_follow_the_staleness_rule():
    cfg = compose(["async_training.max_staleness=2", "async_training.groups_per_step=4", "async_training.sync_every=2"])
    limits = cfg.limits()
    assert limits["groups_per_version"] == 8
    assert limits["max_groups_ahead_of_trainer"] == (2 + 1) * 8
    assert limits["queue_capacity_groups"] == 24
    assert limits["max_inflight_groups"] == min(cfg.rollout.max_concurrent // cfg.rollout.n, 24)


def test_start_concurrent_defaults_to_half_of_max_concurrent():
    assert compose(["rollout.max_concurrent=64"]).rollout.effective_start_concurrent() == 32
    assert compose(["rollout.max_concurrent=1"]).rollout.effective_start_concurrent() == 1
    assert compose(["rollout.start_concurrent=5"]).rollout.effective_start_concurrent() == 5


def test_every_field_has_a_docstring():
    missing = [key for key, _, _, doc in describe() if not doc]
    assert not missing, f"fields without a one-line docstring: {missing}"
    assert "staleness" in field_docs(type(FullyAsyncConfig().async_training))["max_staleness"].lower()


def test_config_modules_import_without_torch_or_ray():
    code = "import sys, fully_async.config, fully_async.runner; assert 'torch' not in sys.modules and 'ray' not in sys.modules, sorted(m for m in sys.modules if m in ('torch', 'ray'))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_runner_prints_composed_config_and_rejects_bad_keys(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fully_async.runner", "--cfg", "job", "rollout.n=8"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    printed = yaml.safe_load(out.stdout)
    assert printed["rollout"]["n"] == 8 and printed["async_training"]["max_staleness"] == 1

    bad = subprocess.run(
        [sys.executable, "-m", "fully_async.runner", "rollout.temprature=0.5", f"hydra.run.dir={tmp_path}/run"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "did you mean 'rollout.temperature'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_list_of_paths_keys_take_one_string_or_a_list_and_expand_home():
    home = str(Path.home())
    cfg = compose(["data.train_files=~/data/gsm8k/train.parquet", "data.val_files=[~/a.parquet,/b.jsonl]"])
    assert cfg.data.train_files == [f"{home}/data/gsm8k/train.parquet"]
    assert cfg.data.val_files == [f"{home}/a.parquet", "/b.jsonl"]
    cfg = build_config({"data": {"train_files": "/x.parquet"}, "reward": {"sources": [
        {"kind": "reward_model", "reward_model": {"urls": "http://127.0.0.1:1"}}]}})  # fmt: skip
    assert cfg.data.train_files == ["/x.parquet"]
    assert cfg.reward.sources[0].reward_model.urls == ["http://127.0.0.1:1"]
    assert compose(["model.path=~/m"]).model.path == f"{home}/m"
    with pytest.raises(ConfigError, match=r"data.train_files\[0\] must be a string"):
        build_config({"data": {"train_files": [3]}})


# verl key -> (value, our key, our value): each mapped verl key is read as ours.
VERL_MAPPED = [
    ("actor_rollout_ref.rollout.n", "8", "rollout.n", 8),
    ("actor_rollout_ref.rollout.temperature", "0.7", "rollout.temperature", 0.7),
    ("actor_rollout_ref.rollout.top_p", "0.9", "rollout.top_p", 0.9),
    ("actor_rollout_ref.rollout.top_k", "5", "rollout.top_k", 5),
    ("actor_rollout_ref.rollout.response_length", "64", "rollout.response_length", 64),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", "0.5", "engine.gpu_memory_utilization", 0.5),
    ("actor_rollout_ref.rollout.max_model_len", "600", "engine.max_model_len", 600),
    ("actor_rollout_ref.rollout.enforce_eager", "false", "engine.enforce_eager", False),
    ("actor_rollout_ref.actor.optim.lr", "1e-5", "trainer.lr", 1e-5),
    ("actor_rollout_ref.actor.optim.weight_decay", "0.01", "trainer.weight_decay", 0.01),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps", "3", "trainer.lr_warmup_steps", 3),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type", "cosine", "trainer.lr_schedule", "cosine"),
    ("actor_rollout_ref.actor.optim.clip_grad", "0.5", "trainer.grad_clip", 0.5),
    ("actor_rollout_ref.actor.grad_clip", "0.25", "trainer.grad_clip", 0.25),
    ("actor_rollout_ref.actor.ppo_epochs", "2", "trainer.ppo_epochs", 2),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "2048", "trainer.max_token_len_per_gpu", 2048),
    ("actor_rollout_ref.actor.clip_ratio_low", "0.1", "algorithm.clip_ratio_low", 0.1),
    ("actor_rollout_ref.actor.clip_ratio_high", "0.3", "algorithm.clip_ratio_high", 0.3),
    ("actor_rollout_ref.actor.use_kl_loss", "true", "algorithm.use_kl_loss", True),
    ("actor_rollout_ref.actor.kl_loss_coef", "0.01", "algorithm.kl_loss_coef", 0.01),
    ("actor_rollout_ref.actor.entropy_coeff", "0.001", "algorithm.entropy_coeff", 0.001),
    ("actor_rollout_ref.actor.loss_agg_mode", "seq-mean-token-mean", "algorithm.loss_agg_mode", "seq-mean-token-mean"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "gspo", "algorithm.policy_loss", "gspo"),
    ("actor_rollout_ref.model.path", "/models/m", "model.path", "/models/m"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "true", "trainer.gradient_checkpointing", True),
    ("actor_rollout_ref.model.lora_rank", "32", "model.lora.rank", 32),
    ("actor_rollout_ref.model.lora_alpha", "64", "model.lora.alpha", 64),
    ("actor_rollout_ref.model.target_modules", "all-linear", "model.lora.target_modules", ["all-linear"]),
    ("algorithm.norm_adv_by_std_in_grpo", "false", "algorithm.norm_adv_by_std", False),
    ("critic.optim.lr", "3e-6", "trainer.critic_lr", 3e-6),
    ("critic.cliprange_value", "0.2", "algorithm.value_clip", 0.2),
    ("data.max_response_length", "48", "rollout.response_length", 48),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", "2", "engine.tensor_parallel_size", 2),
    ("async_training.trigger_parameter_sync_step", "4", "async_training.sync_every", 4),
    ("rollout.test_freq", "5", "trainer.val_every", 5),
    (
        "actor_rollout_ref.rollout.multi_turn.tool_config_path",
        "/t.yaml",
        "rollout.multi_turn.tool_config_path",
        "/t.yaml",
    ),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", "3", "rollout.multi_turn.max_turns", 3),
    ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls", "2", "rollout.multi_turn.max_parallel_calls", 2),
    ("reward_model.overlong_buffer.len", "1", "reward.overlong_buffer", 1),
    ("reward_model.overlong_buffer.penalty_factor", "0.5", "reward.overlong_penalty", 0.5),
    ("trainer.total_training_steps", "7", "trainer.total_steps", 7),
    ("trainer.project_name", "p", "logger.project", "p"),
    ("trainer.experiment_name", "e", "logger.run_name", "e"),
    ("trainer.logger", "[console,jsonl]", "logger.backends", ["console", "jsonl"]),
    ("trainer.resume_from_path", "/ckpt/step_3", "trainer.resume", "/ckpt/step_3"),
    ("actor_rollout_ref.rollout.enable_chunked_prefill", "false", "engine.enable_chunked_prefill", False),
    ("actor_rollout_ref.rollout.max_num_batched_tokens", "4096", "engine.max_num_batched_tokens", 4096),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.len", "1", "reward.overlong_buffer", 1),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "0.5", "reward.overlong_penalty", 0.5),
    ("rollout.total_epochs", "3", "trainer.total_epochs", 3),
    ("actor_rollout_ref.rollout.val_kwargs.temperature", "0.6", "rollout.val.temperature", 0.6),
    ("actor_rollout_ref.rollout.val_kwargs.top_p", "0.7", "rollout.val.top_p", 0.7),
    ("actor_rollout_ref.rollout.val_kwargs.top_k", "-1", "rollout.val.top_k", -1),
    ("actor_rollout_ref.rollout.val_kwargs.do_sample", "False", "rollout.val.do_sample", False),
    ("actor_rollout_ref.rollout.val_kwargs.n", "30", "rollout.val.n", 30),
    ("actor_rollout_ref.actor.clip_ratio_c", "10.0", "algorithm.policy_loss_args", {"clip_ratio_c": 10.0}),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "2", "trainer.tensor_parallel_size", 2),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", "2", "trainer.pipeline_parallel_size", 2),
    ("actor_rollout_ref.actor.megatron.context_parallel_size", "2", "trainer.context_parallel_size", 2),
]
MAPPED_CONTEXT = {"actor_rollout_ref.actor.megatron": ["trainer.strategy=megatron", "trainer.n_gpus_per_node=2"]}
"""Overrides a mapped key needs beside it to compose (keyed by the verl key's prefix)."""
MAPPED_ELSEWHERE = {"trainer.default_local_dir"}
"""Mapped to a Hydra key (hydra.run.dir), tested in tests/unit/config/test_verl_scripts.py."""


def test_every_mapped_verl_key_is_tested():
    from fully_async.config.verl_table import MAPPED

    assert sorted(set(MAPPED) - MAPPED_ELSEWHERE) == sorted(k for k, _, _, _ in VERL_MAPPED)


@pytest.mark.parametrize(("verl_key", "value", "ours", "expected"), VERL_MAPPED, ids=lambda x: str(x))
def test_a_verl_key_with_our_meaning_is_read_as_ours(verl_key, value, ours, expected, capsys):
    context = next((c for prefix, c in MAPPED_CONTEXT.items() if verl_key.startswith(prefix)), [])
    cfg = compose([*context, f"{verl_key}={value}"])
    node = cfg
    for part in ours.split("."):
        node = getattr(node, part)
    assert node == expected
    assert f"{verl_key} -> {ours}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "replacement"),
    [
        ("actor_rollout_ref.actor.ppo_mini_batch_size=0", "must be >= 1"),
        ("async_training.concurrent_samples_per_replica=4", "rollout.max_concurrent=<concurrent_samples_per_replica"),
        ("trainer.test_freq=often", "trainer.test_freq must be an integer"),
        ("trainer.resume_mode=sometimes", "read values: auto (-> trainer.resume=auto)"),
        ("+actor_rollout_ref.model.override_config.max_position_embeddings=8", "config.json: edit it there"),
        ("actor_rollout_ref.rollout.name=hf", "vllm (-> engine=vllm), sglang (-> engine=sglang)"),
        ("+actor_rollout_ref.actor.fsdp_config.param_offload=true", "FSDP CPU offload is not wired"),
        ("+actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "no Ulysses sequence parallelism"),
    ],
)
def test_a_verl_key_with_another_meaning_is_refused_with_its_replacement(override, replacement):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert override.lstrip("+").split("=")[0] in str(err.value)
    assert replacement in str(err.value)


def test_a_verl_section_in_a_yaml_mapping_names_the_migration_table():
    with pytest.raises(ConfigError, match="unknown config key 'actor_rollout_ref' \\(a verl section"):
        build_config({"actor_rollout_ref": {"rollout": {"n": 4}}})


def test_runner_reads_a_verl_command_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fully_async.runner", "--cfg", "job", "data.train_files=~/data/gsm8k/train.parquet",
         "actor_rollout_ref.rollout.n=8"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    printed = yaml.safe_load(out.stdout)
    train = [str(Path("~/data/gsm8k/train.parquet").expanduser())]  # printed resolved: a list, `~` expanded
    assert printed["data"]["train_files"] == train and printed["rollout"]["n"] == 8
    assert "renamed: actor_rollout_ref.rollout.n -> rollout.n" in out.stderr


def test_lora_adapter_sync_with_the_emulated_engines_is_refused_before_anything_starts():
    from fully_async.config import ConfigError

    with pytest.raises(ConfigError, match="model.lora.sync=adapter cannot work with engine.kind=sim"):
        compose(["engine=sim", "model.lora.rank=8", "model.lora.sync=adapter"])
    compose(["engine=sim", "model.lora.rank=8"])  # auto: the merged fallback, said at start
