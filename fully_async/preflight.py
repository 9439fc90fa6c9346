"""Checks that need the file system but not Ray, run by the runner before Ray starts: a wrong model path or a broken
data file answers in seconds with our own one-line message, not as a RayTaskError after the engines are placed.

What is checked: model.path (an existing directory holding a config.json, or a Hugging Face hub id found in the
local cache; fully_async/models/hub.py, which downloads only when the hub is online) or the tiny model's build, and
every row of data.train_files (and data.val_files when validation runs), read by data.py's own loader so the rules
are the ones the run applies. Imports neither torch nor ray at module level (the tiny model's build imports torch).
"""

from __future__ import annotations

from pathlib import Path

from fully_async.config import FullyAsyncConfig


def check_data(cfg: FullyAsyncConfig) -> None:
    """Read every row the run will read; raise DataError naming the file and row of the first bad one."""
    from fully_async.data import load_rows

    if cfg.data.train_files:
        load_rows(cfg.data.train_files, cfg.data.prompt_key)
    if cfg.data.val_files and cfg.trainer.val_every:
        load_rows(cfg.data.val_files, cfg.data.prompt_key)


def preflight(cfg: FullyAsyncConfig, plan_only: bool = False) -> Path | None:
    """Check the data files, then resolve the run's model directory. Raises DataError or ConfigError (model.path).

    `plan_only` (`--plan`): nothing is checked and None returned; a placement plan needs neither the model nor the
    data, and is often made on a machine that has neither (a laptop planning a GPU cluster's run)."""
    if plan_only:
        return None
    check_data(cfg)
    from fully_async.models import resolve_run_model

    return resolve_run_model(cfg)
