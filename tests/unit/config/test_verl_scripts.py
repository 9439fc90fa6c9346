"""verl's own scripts, as verl ships them, through our command line: every key mapped, passed through, noted or
refused for a documented reason.

tests/data/verl_scripts/*.args are the argument lists of verl's fully_async_policy shell scripts and of GRPO, PPO
(GAE, critic) and DAPO examples (each file's header says which), with `$MODEL`, `$DATA`, ... for their paths."""

from __future__ import annotations

import os
import re
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fully_async.config import ConfigError
from fully_async.config.docs import with_verl_refusals
from fully_async.config.verl_keys import translate
from fully_async.config.verl_table import refusals
from fully_async.runner import check_command_line

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = sorted((REPO / "tests/data/verl_scripts").glob("*.args"))
PASSED_ON = "algorithm.rollout_correction"
"""Passed through 1:1 to our section of the same name, which another change adds: either outcome is accepted."""


def _args(path: Path, where: Path) -> list[str]:
    paths = {"MODEL": str(where / "model"), "DATA": str(where / "data"), "CKPT": str(where / "ckpt"),
             "REWARD_FILE": str(where / "reward.py"), "TOOL_CONFIG": str(where / "tools.yaml")}  # fmt: skip
    lines = path.read_text().splitlines()
    return [string.Template(ln).substitute(paths) for ln in lines if ln.strip() and not ln.startswith("#")]


def _refused_key(problem: str, documented: list[str]) -> str | None:
    """The documented key (or prefix*) a problem line refuses, or None when the problem is not a documented refusal."""
    for key in documented:
        stem = key.rstrip("*")
        if problem.startswith(stem) and (key.endswith("*") or problem[len(stem)] in "= "):
            return key
    return None


def test_there_are_the_scripts_verl_ships():
    names = {p.name.split("_")[0] for p in SCRIPTS}
    assert len(SCRIPTS) >= 20 and {"fully", "grpo", "ppo", "e2e", "gmpo"} <= names
    assert sum(p.name.startswith("fully_async_") for p in SCRIPTS) == 12  # every verl fully_async_policy/shell script


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_key_of_a_verl_script_is_read_or_refused_for_a_documented_reason(script, tmp_path, capsys):
    args = _args(script, tmp_path)
    documented = [k for k, _, _ in refusals()]
    try:
        check_command_line([*args, "--cfg", "job"])
        problems = []
    except ConfigError as e:
        problems = [re.sub(r"^\s*\d+\.\s*", "", p) for p in str(e).splitlines()[1:] if p.strip()]
        problems = problems or [str(e)]
    unexplained = [p for p in problems if _refused_key(p, documented) is None and PASSED_ON not in p
                   and not p.startswith("algorithm.rollout_is")]  # fmt: skip
    assert not unexplained, "\n".join(unexplained)
    err = capsys.readouterr().err
    summary = err[err.index("verl keys read") :] if "verl keys read" in err else ""
    t = translate(args)
    assert err.count("verl keys read") == 1 and len(summary.splitlines()) < max(12, t.keys_read())  # one block
    for arg in args:  # every verl key read is named in it once
        key = arg.lstrip("+").partition("=")[0]
        if any(key in item for items in t.read.values() for item in items):
            assert len(re.findall(rf"(?<![\w.]){re.escape(key)}(?![\w.])", summary)) == 1, key


def test_a_dapo_line_answers_whole_in_one_run(tmp_path):
    """The runner's `--cfg job` on verl's fully-async DAPO script: rc 0 but for documented refusals, in one run (how
    fast: scripts/bench/verl_scripts.py; about 1 s idle)."""
    args = _args(REPO / "tests/data/verl_scripts/fully_async_dapo_7b_math_fsdp2_4_12.args", tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fully_async.runner", *args, "--cfg", "job"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    elapsed = time.monotonic() - started
    documented = [k for k, _, _ in refusals()]
    refused = re.findall(r"^(?:\s*\d+\.|ConfigError:) (\S+?)=", out.stderr, re.M)  # one problem or a list
    assert out.returncode in (0, 2) and "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 0 or (refused and all(_refused_key(f"{k}=", documented) for k in refused)), out.stderr
    assert (out.returncode == 0) == ("async_training:" in out.stdout)  # the config is printed only when valid
    assert elapsed < 60, f"{elapsed:.1f} s"  # a hang guard only: timings are the benchmark's (docs/benchmarks.md)


def test_the_migration_guide_lists_every_refusal_of_the_table():
    """docs/migration-from-verl.md's refusal block is generated from the table (rewrite it with
    `python -m fully_async.config.docs --verl-refusals`)."""
    doc = (REPO / "docs/migration-from-verl.md").read_text()
    assert with_verl_refusals(doc) == doc, "stale: run python -m fully_async.config.docs --verl-refusals"
    assert all(f"`{key}`" in doc for key, _, _ in refusals())


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (["trainer.save_freq=-1"], ("trainer.save_every", 0)),
        (["trainer.save_freq=20"], ("trainer.save_every", 20)),
        (["trainer.resume_mode=auto"], ("trainer.resume", "auto")),
        (["trainer.resume_mode=disable"], ("trainer.resume", "none")),
        (["actor_rollout_ref.actor.clip_ratio_c=10.0"], ("algorithm.policy_loss_args", {"clip_ratio_c": 10.0})),
        (["trainer.test_freq=10", "async_training.trigger_parameter_sync_step=4"], ("trainer.val_every", 3)),
        (["trainer.test_freq=-1"], ("trainer.val_every", 0)),
        (["actor_rollout_ref.rollout.max_num_batched_tokens=8192"], ("engine.max_num_batched_tokens", 8192)),
        (["actor_rollout_ref.rollout.enable_chunked_prefill=False"], ("engine.enable_chunked_prefill", False)),
        (["+reward_model.reward_kwargs.overlong_buffer_cfg.len=16", "data.max_response_length=64"],
         ("reward.overlong_buffer", 16)),
        (["--config-name=fully_async_ppo_megatron_trainer.yaml"], ("trainer.strategy", "megatron")),
        (["trainer.logger=console"], ("logger.backends", ["console"])),
    ],
)  # fmt: skip
def test_a_verl_key_becomes_ours(line, expected):
    from fully_async.config import compose

    key, value = expected
    node = compose(line)
    for part in key.split("."):
        node = getattr(node, part)
    assert node == value


def test_verls_checkpoint_directory_is_the_run_directory():
    t = translate(["trainer.default_local_dir=/ckpts/run1"])
    assert t.overrides == ["hydra.run.dir=/ckpts/run1"] and not t.problems


def test_the_reference_models_keys_are_noted_only_while_no_kl_term_uses_it():
    off = translate(["actor_rollout_ref.ref.fsdp_config.param_offload=True"])
    assert not off.problems and "configures a part not in use: actor_rollout_ref.ref" in off.summary()
    on = translate(["actor_rollout_ref.ref.fsdp_config.param_offload=True", "actor_rollout_ref.actor.use_kl_loss=True"])
    assert len(on.problems) == 1 and "param_offload=True" in on.problems[0]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (["trainer.save_freq=often"], "trainer.save_freq=often has no counterpart here"),
        (["critic.model.path=/other", "actor_rollout_ref.model.path=/m"], "differs from actor_rollout_ref.model.path"),
        (["actor_rollout_ref.model.override_config.max_position_embeddings=32768"], "edit it there"),
        (["reward_model.reward_manager=prime"], "reward_manager=prime would change what verl does"),
    ],
)  # fmt: skip
def test_what_cannot_be_done_is_refused_with_the_reason(line, problem):
    t = translate(line)
    assert len(t.problems) == 1 and problem in t.problems[0], t.problems


def test_verls_custom_reward_function_file_becomes_a_reward_source_that_scores(tmp_path, monkeypatch):
    """custom_reward_function.path (a file, relative to where the command runs) and .name: one reward source of that
    function by absolute path, loaded from the file (no package needed), with verl's compute_score signature."""
    from fully_async.config import compose
    from fully_async.plugins import load

    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(
        "def exact(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str.strip() == ground_truth else -1.0\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = compose(["custom_reward_function.path=rewards/mine.py", "custom_reward_function.name=exact"])
    (source,) = cfg.reward.sources
    assert source.kind == f"{tmp_path}/rewards/mine.py:exact" and source.label == "exact"
    fn = load(source.kind)
    assert fn("d", " 42 ", "42", {}) == 1.0 and fn("d", "41", "42", {}) == -1.0
    assert load(source.kind) is fn  # imported once per process
    with pytest.raises(ConfigError, match="needs custom_reward_function.path"):
        compose(["custom_reward_function.name=exact"])
    with pytest.raises(ConfigError, match="cannot import module"):
        load(f"{tmp_path}/rewards/missing.py:exact")
