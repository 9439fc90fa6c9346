"""An explicit key always wins (config/base.py `settable`): a key set in a YAML or on the command line, even to its
default value, is kept by every mechanism that sets other keys: rollout-correction presets, older keys read as newer
ones, a built-in task's own agent loop, and the keys a verl command line implies. Composed as the runner composes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fully_async.config import ConfigError, FullyAsyncConfig, compose, from_dict, to_dict
from fully_async.config.base import origins
from fully_async.config.sections import DEFAULT_AGENT_LOOP, GUESS_LOOP, PRESETS

REPO = Path(__file__).resolve().parents[3]
RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    ("preset", "key", "value", "written"),
    [
        ("bypass_pg_geo_rs", "bypass_mode", False, "false"),  # issue 47: it composed to True
        ("bypass_pg_geo_rs", "loss_type", "ppo_clip", "ppo_clip"),
        ("decoupled_geo_rs", "rollout_is", "token", "token"),
        ("decoupled_token_icepop", "rollout_is_threshold", 2.0, "2.0"),
        ("decoupled_seq_is_rs", "rollout_rs", None, "null"),
        ("decoupled_token_is", "rollout_is_batch_normalize", False, "false"),
    ],
)
def test_a_key_set_to_its_default_survives_the_preset(preset, key, value, written):
    rc = compose([f"{RC}.preset={preset}", f"{RC}.{key}={written}"]).algorithm.rollout_correction
    assert getattr(rc, key) == value
    for other, preset_value in PRESETS[preset].items():  # the preset still sets every key nobody set
        if other != key:
            assert getattr(rc, other) == preset_value, other
    marked = origins(rc)
    assert key not in marked and all(marked[k] == f"preset {preset}" for k in PRESETS[preset] if k != key)


def test_a_key_in_a_yaml_survives_a_preset_from_the_yaml_or_the_command_line(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - fully_async\n  - _self_\nhydra:\n  searchpath:\n    - pkg://fully_async.config\n"
        "algorithm:\n  rollout_correction:\n    preset: bypass_pg_geo_rs\n    bypass_mode: false\n"
    )
    rc = compose(config_dir=tmp_path, config_name="mine").algorithm.rollout_correction
    assert (rc.bypass_mode, rc.loss_type, rc.rollout_rs) == (False, "reinforce", "seq_mean_k1")
    rc = compose([f"{RC}.preset=bypass_pg_is"], config_dir=tmp_path, config_name="mine").algorithm.rollout_correction
    assert (rc.bypass_mode, rc.loss_type, rc.rollout_is) == (False, "reinforce", "sequence")


def test_an_older_key_beats_a_preset_and_clashes_with_its_new_key():
    rc = compose(["algorithm.rollout_is=token", f"{RC}.preset=decoupled_geo_rs"]).algorithm.rollout_correction
    assert rc.rollout_is == "token" and origins(rc)["rollout_is"] == "older key algorithm.rollout_is"
    with pytest.raises(ConfigError, match=rf"{RC}.bypass_mode is set twice, to True and \(by the older key "):
        compose(["algorithm.recompute_prox=true", f"{RC}.bypass_mode=true", f"{RC}.preset=bypass_pg_is"])
    with pytest.raises(ConfigError, match=rf"{RC}.rollout_is is set twice, to 'sequence'"):
        compose(["algorithm.rollout_is=token", f"{RC}.rollout_is=sequence"])
    rc = compose(["algorithm.rollout_is=token", f"{RC}.rollout_is=token"]).algorithm.rollout_correction
    assert rc.rollout_is == "token"  # the same value twice: one meaning


def test_a_moved_key_clashes_with_its_new_place_set_to_the_default():
    assert compose(["async_training.bucket_mb=64"]).advanced.bucket_mb == 64
    with pytest.raises(ConfigError, match=r"advanced.bucket_mb is set twice, to 16 and \(by the older key "
                                          r"async_training.bucket_mb\) to 64"):  # fmt: skip
        compose(["async_training.bucket_mb=64", "advanced.bucket_mb=16"])
    with pytest.raises(ConfigError, match=r"advanced.ignore_eos is set twice"):
        compose(["rollout.ignore_eos=true", "advanced.ignore_eos=false"])


def test_an_agent_loop_set_to_the_default_survives_the_tasks_own_loop():
    assert compose(["data.synthetic_task=guess"]).agent_loop_path() == GUESS_LOOP
    cfg = compose(["data.synthetic_task=guess", f"rollout.agent_loop={DEFAULT_AGENT_LOOP}"])
    assert cfg.agent_loop_path() == DEFAULT_AGENT_LOOP and "rollout.agent_loop" not in origins(cfg)


def test_a_key_a_verl_line_implies_keeps_the_value_set_explicitly():
    verl = ["actor_rollout_ref.rollout.response_length=64", "trainer.total_epochs=2"]
    implied = compose(verl)
    assert (implied.engine.max_model_len, implied.trainer.total_steps) == (implied.data.max_prompt_length + 64, 0)
    cfg = compose([*verl, "engine.max_model_len=512", "trainer.total_steps=100"])  # both their defaults
    assert (cfg.engine.max_model_len, cfg.trainer.total_steps) == (512, 100)


def test_the_resolved_config_survives_its_round_trip():
    """The rollouter rebuilds the config from to_dict: every key is given there, so nothing is filled twice."""
    cfg = compose([f"{RC}.preset=bypass_pg_geo_rs", f"{RC}.bypass_mode=false", "algorithm.rollout_is=token",
                   "data.synthetic_task=guess", "async_training.bucket_mb=32"])  # fmt: skip
    again = from_dict(FullyAsyncConfig, to_dict(cfg)).validate()
    assert to_dict(again) == to_dict(cfg)


def test_cfg_job_prints_the_resolved_values_and_what_the_preset_set(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "fully_async.runner", "--cfg", "job", f"{RC}.preset=bypass_pg_geo_rs",
         f"{RC}.bypass_mode=false"],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=True, timeout=120,
    )  # fmt: skip
    rc = yaml.safe_load(out.stdout)["algorithm"]["rollout_correction"]
    assert (rc["bypass_mode"], rc["loss_type"], rc["rollout_rs"]) == (False, "reinforce", "seq_mean_k1")
    lines = {line.split(":")[0].strip(): line for line in out.stdout.splitlines()}
    assert lines["loss_type"].endswith("# from preset bypass_pg_geo_rs")
    assert lines["rollout_rs"].endswith("# from preset bypass_pg_geo_rs")
    assert "#" not in lines["bypass_mode"]  # the command line's
