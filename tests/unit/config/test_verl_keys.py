"""A verl user's command line: read in one pass, every problem reported at once, before Ray or torch start.

The fixture tests/data/verl_fully_async_recipe.args is a verl fully-async recipe command line (every key verl's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fully_async.config import ConfigError, FullyAsyncConfig, build_config, compose
from fully_async.config.base import schema_node
from fully_async.config.sections import GUESS_LOOP
from fully_async.config.verl_table import CHOICES, CONVERTED, MAPPED, REPLACED, SAME

REPO = Path(__file__).resolve().parents[3]
RECIPE = [ln for ln in (REPO / "tests/data/verl_fully_async_recipe.args").read_text().splitlines() if "=" in ln]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}  # the subprocess imports this checkout, not an installed copy


def _runner(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fully_async.runner", *args], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=120)  # fmt: skip


def test_the_recipe_command_line_is_read_whole(capsys):
    assert len(RECIPE) >= 40
    cfg = compose(RECIPE)
    at = cfg.async_training
    assert (at.groups_per_step, cfg.trainer.num_mini_batches) == (2 * 32, 2)  # require_batches x ppo_mini_batch_size
    assert (at.max_staleness, at.sync_every, at.partial_rollout) == (1, 4, True)  # ceil(0.5), trigger_parameter_sync
    assert cfg.trainer.total_steps == 204800 // 64 and cfg.trainer.val_every == 10
    assert (cfg.engine.kind, cfg.engine.num_servers, cfg.engine.tensor_parallel_size) == ("vllm", 2, 1)
    assert (cfg.rollout.n, cfg.rollout.response_length, cfg.data.max_prompt_length) == (16, 512, 256)
    assert (cfg.trainer.lr, cfg.trainer.strategy, cfg.logger.backends) == (1e-6, "fsdp2", ["console"])
    err = capsys.readouterr().err
    for line in RECIPE:  # each verl key is accounted for on stderr: a renamed or noted key once, a converted one
        key = line.partition("=")[0]  # in the arithmetic of what it became
        if key in MAPPED or key in SAME or key in CHOICES:
            assert len(re.findall(rf"(?<![\w.]){re.escape(key)}(?![\w.])", err)) == 1, key
        elif key in CONVERTED:
            assert re.search(rf"{re.escape(key)}=\S+.*: read as ", err) or f"verl key {key}=" in err, key
    assert "read as async_training.max_staleness=1" in err and "so here anyway: " in err


def test_every_problem_of_a_command_line_in_one_run_under_a_few_seconds(tmp_path):
    broken = [*RECIPE, "actor_rollout_ref.actor.use_dynamic_bsz=False", "actor_rollout_ref.rollout.name=hf",
              "actor_rollout_ref.actor.fsdp_config.param_offload=True", "+actor_rollout_ref.model.override_config.x=3",
              "rollout.temprature=2", "engine.kind=foo", "trainer.ppo_epochs=0", "rollout.top_p=2"]  # fmt: skip
    started = time.monotonic()
    out = _runner(*broken, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert out.returncode == 2, out.stderr
    assert "ConfigError: 8 problems:" in out.stderr
    for key in ("use_dynamic_bsz=False", "rollout.name=hf", "param_offload=True", "override_config.x=3 is refused",
                "did you mean 'rollout.temperature'", "engine.kind must be one of", "trainer.ppo_epochs must be >= 1",
                "rollout.top_p must be in (0, 1]"):  # fmt: skip
        assert key in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()  # nothing started
    assert elapsed < 10, f"{elapsed:.1f} s"  # ~1 s on an idle machine (docs/migration-from-verl.md)


def test_cfg_job_validates(tmp_path):
    out = _runner("--cfg", "job", "rollout.n=1", cwd=tmp_path)
    assert out.returncode == 2 and "rollout.n must be >= 2 with algorithm.adv_estimator=grpo" in out.stderr
    assert "async_training:" not in out.stdout  # not printed as if it were valid


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (["data.train_batch_size=0"], "data.train_batch_size=0 is the fully-async recipe's 'derive it'"),
        (["async_training.require_batches=2"], "needs actor_rollout_ref.actor.ppo_mini_batch_size"),
        (["data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], "must be a multiple of"),
        (["data.train_batch_size=10", "async_training.require_batches=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
         "disagrees with async_training.require_batches=2 x actor_rollout_ref.actor.ppo_mini_batch_size=4"),
        (["async_training.staleness_threshold=-1"], "async_training.staleness_threshold must be >= 0"),
        (["rollout.n_gpus_per_node=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "a multiple of"),
        (["actor_rollout_ref.rollout.n=8", "rollout.n=4"], "rollout.n is set twice, to 4 and (from a verl key) to 8"),
        (["actor_rollout_ref.rollout.calculate_log_probs=False"], "behaviour log-probs always come from the engine"),
    ],
)  # fmt: skip
def test_a_conversion_that_does_not_work_out_is_refused_naming_the_keys(line, problem):
    with pytest.raises(ConfigError) as err:
        compose(line)
    assert problem in str(err.value)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (["data.train_batch_size=16"], (16, 1)),  # verl's synchronous trainer: one mini-batch
        (["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], (16, 4)),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], (4, 1)),  # the recipe's require_batches defaults to 1
        (["data.train_batch_size=0", "async_training.require_batches=3",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4"], (12, 3)),
    ],
)  # fmt: skip
def test_verl_batch_sizes_become_groups_per_step_and_mini_batches(line, expected):
    cfg = compose(line)
    assert (cfg.async_training.groups_per_step, cfg.trainer.num_mini_batches) == expected


def test_a_verl_engine_name_picks_our_engine_option():
    assert compose(["actor_rollout_ref.rollout.name=sglang"]).engine.kind == "sglang"
    cfg = compose(["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"])
    assert cfg.async_training.weight_transport == "collective"


def test_every_verl_key_the_migration_guide_maps_is_read():
    """Each verl key in the first column of docs/migration-from-verl.md's tables is read on the command line (mapped,
    converted, noted or refused with its replacement) or is ours already, never met as an unknown key. A short name
    in a cell (`top_p` after `actor_rollout_ref.rollout.temperature`) sits beside the full key before it."""
    known = {*MAPPED, *SAME, *CHOICES, *CONVERTED, *REPLACED}
    doc = (REPO / "docs/migration-from-verl.md").read_text()
    missing, seen = [], 0
    for section, parent in (("## `async_training`", "async_training"), ("## Rollout, data, model, algorithm", "")):
        table = doc.split(section, 1)[1].split("\n## ", 1)[0]
        for row in table.splitlines()[2:]:
            if not row.startswith("|"):
                continue
            last = f"{parent}.x"
            for key in re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)", row.split("|")[1]):
                full = key if "." in key else f"{last.rpartition('.')[0]}.{key}".lstrip(".")
                last, seen = full, seen + 1
                if full not in known and schema_node(FullyAsyncConfig, full.split("."))[1] is not None:
                    missing.append(full)
    assert seen > 60 and not missing, f"keys the guide maps but the command line does not read: {missing}"


def test_data_synthetic_task_guess_alone_brings_the_task_settings():
    cfg = compose(["data.synthetic_task=guess"])
    turns = cfg.rollout.multi_turn
    assert (cfg.rollout.response_length, turns.max_turns, turns.max_tokens_per_turn) == (64, 2, 1)
    assert cfg.agent_loop_path() == GUESS_LOOP
    assert compose(["data.synthetic_task=guess", "rollout.response_length=48"]).rollout.response_length == 48
    assert compose(["task=guess"]).data.synthetic_task == "guess"
    assert compose([]).rollout.response_length == 1  # the copy task keeps its one-token answers


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (["data.synthetic_task=guess", "rollout.multi_turn.max_turns=1"], "max_turns must be >= 2"),
        (["data.synthetic_task=guess", "rollout.multi_turn.max_tokens_per_turn=0"], "max_tokens_per_turn must be in"),
    ],
)
def test_a_task_that_cannot_run_as_configured_is_refused(line, problem):
    with pytest.raises(ConfigError, match=problem):
        compose(line)


def test_a_guess_task_set_in_yaml_without_its_settings_is_refused():
    with pytest.raises(ConfigError, match="task=guess sets the task's settings"):
        build_config({"data": {"synthetic_task": "guess"}})
