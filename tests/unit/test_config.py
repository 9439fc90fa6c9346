"""Config composition and validation: every shipped config validates; bad configs name the key."""

from __future__ import annotations

import dataclasses
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

REPO = Path(__file__).resolve().parents[2]


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
    (["async_training.weight_transport=collective"], "async_training.weight_transport", "not built yet"),
    (["rollout.temperature=0"], "rollout.temperature", "> 0"),
    (["rollout.top_p=1.5"], "rollout.top_p", "(0, 1]"),
    (["engine.dtype=fp8"], "engine.dtype", "one of"),
    (["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator", "did you mean 'grpo'"),
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
