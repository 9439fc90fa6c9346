"""The runner's checks before Ray starts (fully_async/preflight.py): a wrong model path or a broken data file answers
in seconds with our own one line, exit code 2, not as a RayTaskError after the engines are placed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fully_async.config import ConfigError, compose
from fully_async.data import DataError
from fully_async.preflight import check_data, preflight

REPO = Path(__file__).resolve().parents[2]
ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "1+1?"}],
    "reward_model": {"ground_truth": "2"},
}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": "", "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fully_async.runner", *overrides, f"hydra.run.dir={tmp_path}/run"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)  # fmt: skip
    return out, time.monotonic() - started


def _before_ray(out: subprocess.CompletedProcess, elapsed: float) -> None:
    assert out.returncode == 2, out.stderr
    assert "RayTaskError" not in out.stderr and "Traceback" not in out.stderr
    assert "run dir" not in out.stdout  # printed only once the checks passed, right before Ray starts
    assert elapsed < 20, f"{elapsed:.1f} s"  # a few seconds on an idle machine (docs/migration-from-verl.md)


def test_a_missing_model_path_is_refused_before_ray(tmp_path):
    out, elapsed = _run(tmp_path, "model.path=/nonexistent")
    _before_ray(out, elapsed)
    assert "ConfigError: model.path must be an existing Hugging Face model directory" in out.stderr


def test_a_broken_data_file_is_refused_before_ray_naming_the_row(tmp_path):
    bad = _jsonl(tmp_path / "train.jsonl", [ROW, {"prompt": "no source", "reward_model": {"ground_truth": "1"}}])
    out, elapsed = _run(tmp_path, f"data.train_files={bad}")
    _before_ray(out, elapsed)
    assert f"DataError: {bad}:line 2: missing field 'data_source'" in out.stderr


def test_a_simulated_trainer_with_a_real_engine_is_refused_before_ray(tmp_path):
    """trainer=sim writes no weights: with the default vLLM engine the job used to fail at its first sync, minutes
    after the servers started; engine=sim with trainer=sim (the simulation) passes this check."""
    out, elapsed = _run(tmp_path, "trainer=sim")
    _before_ray(out, elapsed)
    assert "ConfigError: trainer.backend=sim cannot feed engine.kind=vllm" in out.stderr
    from fully_async.preflight import check_trainer_feeds_engine

    check_trainer_feeds_engine(compose(["engine=sim", "trainer=sim"]))  # raises nothing


def test_a_vision_language_model_on_an_engine_without_images_is_refused_before_ray(tmp_path):
    """SGLang takes no images yet: task=colors on it used to start the servers, then fail every group at the first
    generate call until the run gave up; vLLM and the emulated engine take a vision-language model."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    out, elapsed = _run(tmp_path, f"model.path={model}", "engine=sglang")
    _before_ray(out, elapsed)
    assert "ConfigError: engine.kind=sglang cannot take images yet" in out.stderr
    from fully_async.preflight import check_engine_takes_images

    for kind in ("vllm", "sim"):
        check_engine_takes_images(compose([f"engine={kind}"]), model)  # raises nothing
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    check_engine_takes_images(compose(["engine=sglang"]), model)  # a text model on SGLang: nothing to refuse


def test_preflight_returns_the_model_directory_and_reads_the_data(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    train = _jsonl(tmp_path / "train.jsonl", [ROW])
    assert preflight(compose([f"model.path={model}", f"data.train_files={train}"])) == model.resolve()
    missing = [f"model.path={tmp_path}/none", f"data.train_files={tmp_path}/none.jsonl"]
    assert preflight(compose(missing), plan_only=True) is None  # --plan needs neither
    (model / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no config.json"):
        preflight(compose([f"model.path={model}"]))


def test_a_hub_id_not_in_the_local_cache_is_refused_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="hub id 'org/not-here' is not in the local Hugging Face cache"):
        preflight(compose(["model.path=org/not-here"]))


def test_validation_files_are_read_only_when_validation_runs(tmp_path):
    bad = _jsonl(tmp_path / "val.jsonl", [{"data_source": "x"}])
    check_data(compose([f"data.val_files={bad}"]))  # trainer.val_every=0: never read by the run
    with pytest.raises(DataError, match="val.jsonl:line 1: missing field 'prompt'"):
        check_data(compose([f"data.val_files={bad}", "trainer.val_every=1"]))


@pytest.mark.parametrize(
    ("line", "rows", "steps"),
    [
        (["trainer.total_epochs=3", "async_training.groups_per_step=16"], 100, 18),  # 3 x floor(100 / 16)
        (["trainer.total_epochs=3", "async_training.groups_per_step=16", "trainer.total_steps=10"], 100, 10),
        (["rollout.total_epochs=2", "async_training.groups_per_step=10"], 100, 20),  # verl's line: epochs alone
        (["async_training.groups_per_step=16"], 100, None),  # no epoch limit: total_steps as composed
    ],
)  # fmt: skip
def test_epochs_are_a_stop_rule_counted_in_whole_steps_of_the_rows(line, rows, steps):
    from fully_async.preflight import limit_to_epochs

    cfg = compose(line)
    composed = cfg.trainer.total_steps
    said = limit_to_epochs(cfg, rows)
    assert cfg.trainer.total_steps == (composed if steps is None else steps)
    assert (said is None) == (cfg.trainer.total_epochs == 0)


def test_epochs_that_fill_no_step_are_refused():
    from fully_async.preflight import limit_to_epochs

    with pytest.raises(ConfigError, match="8 training rows fill no step of async_training.groups_per_step=16"):
        limit_to_epochs(compose(["trainer.total_epochs=1", "async_training.groups_per_step=16"]), 8)


_WANDB_ENV = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_CONFIG_DIR", "WANDB_BASE_URL", "NETRC")


def test_wandb_without_a_key_is_refused_before_ray(tmp_path):
    """verl's `trainer.logger=['console','wandb']` with no wandb key used to start Ray, the engines and the trainer,
    then fail in the trainer's first logger call; now it is a preflight problem, answered in seconds. HOME is a fresh
    directory (a real ~/.netrc key is never read). Ray not started: RAY_TMPDIR points into tmp_path, where a Ray that
    started leaves its session directory, and the runner prints the run dir only right before it imports Ray. The
    emulated engine and trainer keep the run cheap should the check be gone (Ray then starts and the run fails later)."""
    home, ray_dir = tmp_path / "home", tmp_path / "ray"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _WANDB_ENV}
    env |= {"HOME": str(home), "RAY_TMPDIR": str(ray_dir), "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fully_async.runner", "trainer.logger=['console','wandb']",
                          "engine=sim", "trainer=sim", f"hydra.run.dir={tmp_path}/run"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)  # fmt: skip
    _before_ray(out, time.monotonic() - started)
    assert not ray_dir.exists()
    assert "ConfigError: logger.backends includes wandb, and wandb (WANDB_MODE=online) finds no API key" in out.stderr


def test_a_logger_problem_is_listed_with_the_other_preflight_problems(tmp_path, monkeypatch):
    for name in _WANDB_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        preflight(compose(["logger=[console,wandb]", "trainer=sim"]))
    assert len(err.value.problems) == 2, err.value.problems
    assert "finds no API key" in err.value.problems[0] and "trainer.backend=sim cannot feed" in err.value.problems[1]
    monkeypatch.setenv("WANDB_MODE", "offline")  # then wandb logs locally: nothing to refuse for it
    with pytest.raises(ConfigError) as err:
        preflight(compose(["logger=[console,wandb]", "trainer=sim"]))
    assert len(err.value.problems) == 1


def test_wandb_credentials_are_found_where_wandb_reads_them(tmp_path):
    from fully_async.config import LoggerConfig
    from fully_async.loggers import startup_problems

    wandb, plain = LoggerConfig(backends=["console", "wandb"]), LoggerConfig(backends=["console", "tensorboard"])
    home = {"HOME": str(tmp_path)}
    assert startup_problems(plain, home, tmp_path) == []
    assert len(startup_problems(wandb, home, tmp_path)) == 1
    for env in ({"WANDB_API_KEY": "k"}, {"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"}):
        assert startup_problems(wandb, home | env, tmp_path) == [], env
    assert startup_problems(wandb, home | {"WANDB_MODE": "online"}, tmp_path)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password k\n")
    assert startup_problems(wandb, home, tmp_path) == []  # `wandb login` writes there
    assert startup_problems(wandb, home | {"WANDB_BASE_URL": "https://wandb.example.org"}, tmp_path)  # another host
    (tmp_path / ".netrc").unlink()
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = offline\n")  # `wandb offline` in this directory
    assert startup_problems(wandb, home, tmp_path) == []
