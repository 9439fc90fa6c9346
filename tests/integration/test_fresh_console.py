"""A fresh machine's first command keeps the console's promise (only the project's lines): with an empty HOME (no
tiny-model cache, no matplotlib font cache, no Hugging Face cache) a short job builds the tiny model, runs and draws
its plot, and neither transformers' "Writing model shards" bar (models/tiny.py) nor matplotlib's "generated new
fontManager" notice (console.DRIVER_CHATTER: to RUN_DIR/logs/workers.log) reaches the console.

The job is the sim engine and trainer (tests/helpers.SIM_ROLLOUT) through the real runner, local Ray included: what a
first command does on a new machine, minus vLLM's and verl's start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import SIM_ROLLOUT

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
FRESH_ONLY = ("MPLCONFIGDIR", "HF_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TRANSFORMERS_CACHE", "HF_HUB_CACHE")
"""Variables that would point a cache somewhere else than the fresh HOME."""


def test_a_first_run_on_a_fresh_home_prints_only_the_projects_lines(tmp_path):
    home, run_dir = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in FRESH_ONLY}
    env.update(HOME=str(home), RAY_AUTH_MODE="disabled")
    cmd = [sys.executable, "-m", "fully_async.runner", f"hydra.run.dir={run_dir}", *SIM_ROLLOUT,
           "trainer.total_steps=2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    # It was a first run: the tiny model and matplotlib's font cache were built under the fresh HOME by this command.
    assert list((home / ".cache" / "fully_async" / "models").glob("tiny-*/model.safetensors"))
    assert list(home.rglob("fontlist-*.json")) and (run_dir / "reward_staleness.png").is_file()
    assert "Writing model shards" not in console
    assert "fontManager" not in console
    assert "generated new fontManager" in (run_dir / "logs" / "workers.log").read_text()  # kept, in the file
    assert "fully_async: done, step 2" in proc.stdout
