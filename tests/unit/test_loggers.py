"""Metric sinks fed the recorded metrics of a real run (tests/data/recorded_run/metrics.jsonl): what wandb (offline)
and tensorboard write is read back from their files, and the console shows what a user needs."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from fully_async.config import LoggerConfig
from fully_async.loggers import ConsoleLogger, build_loggers
from tests.helpers import wandb_history, wandb_records

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded_run" / "metrics.jsonl"
SECRET = "fa-test-key-0123456789abcdef0123456789abcdef"


def recorded_rows() -> list[dict]:
    return [json.loads(line) for line in RECORDED.read_text().splitlines()]


def test_wandb_offline_and_tensorboard_write_every_step_readably(tmp_path, monkeypatch):
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    wandb.teardown()  # wandb keeps its settings per process: forget an earlier test's
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = recorded_rows()
    cfg = LoggerConfig(backends=["jsonl", "wandb", "tensorboard"], project="fa-tests", run_name="recorded")
    cfg.validate_section("logger.")
    loggers = build_loggers(cfg, tmp_path, total_steps=len(rows), config={"seed": 7})
    for m in rows:
        loggers.log(m["step"], m)
    loggers.close()

    # jsonl: the same rows back
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows

    # tensorboard: every numeric metric as a scalar series, one point per step
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    acc.Reload()
    for key in ("reward/mean", "fully_async/trainer/idle_ratio", "fully_async/rollouter/idle_ratio", "timing_s/step"):
        points = acc.Scalars(key)
        assert [p.step for p in points] == [m["step"] for m in rows]
        assert [p.value for p in points] == pytest.approx([m[key] for m in rows], rel=1e-6)

    # wandb offline: project and name from config, one history record per step with our values
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(log))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "fa-tests" and run.display_name == "recorded"
    assert run.run_id == (tmp_path / "wandb_run_id").read_text()
    history = wandb_history(log)
    assert [h["_step"] for h in history] == [m["step"] for m in rows]
    for h, m in zip(history, rows):
        assert h["reward/mean"] == pytest.approx(m["reward/mean"])
        assert h["fully_async/rollouter/idle_ratio"] == pytest.approx(m["fully_async/rollouter/idle_ratio"])

    # the API key comes from the environment and is written nowhere
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"{path} holds the API key"


def test_a_missing_logger_package_is_a_config_error_naming_the_extra(monkeypatch):
    import importlib.util

    from fully_async.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(
        ConfigError, match=r"logger.backends\[1\]='wandb' needs the 'wandb' package.*fully_async\[wandb\]"
    ):
        LoggerConfig(backends=["console", "wandb"]).validate_section("logger.")


def test_console_shows_progress_reward_staleness_queue_throughput_idle_and_eta(capsys):
    rows = recorded_rows()
    plain = ConsoleLogger(total_steps=12)
    for m in rows:
        plain.log(m["step"], m)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(rows)
    last = rows[-1]
    assert f"step {last['step']}/12" in lines[-1] and f"v{last['version']}" in lines[-1]
    assert f"idle T {last['fully_async/trainer/idle_ratio']:.2f}" in lines[-1] and "eta" in lines[-1]

    from rich.console import Console

    out = io.StringIO()
    live = ConsoleLogger(total_steps=12, console=Console(file=out, force_terminal=True, width=100))
    assert live.live is not None
    for m in rows:
        live.log(m["step"], m)
    live.close()
    text = out.getvalue()
    for label in ("step", "reward", "staleness", "queue", "tokens/s", "idle", "ETA"):
        assert label in text
    assert f"{last['step']}/12" in text
    assert not math.isnan(live.eta_s(last["step"]))


def test_wandb_that_cannot_start_fails_with_what_to_set(tmp_path, monkeypatch):
    """WANDB_MODE=online with no API key and no network: a LoggerError naming the fix, not a prompt or a hang."""
    import wandb

    from fully_async.loggers import LoggerError

    wandb.teardown()  # wandb keeps its settings per process: forget an earlier test's offline mode
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: no network in any environment
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "10")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = LoggerConfig(backends=["wandb"])
    with pytest.raises(LoggerError, match="WANDB_MODE=offline"):
        build_loggers(cfg, tmp_path, total_steps=1)


def test_the_eta_waits_for_the_pipeline_fill_then_follows_the_pace(capsys):
    """A 19 s first step (engines warming up, the first batches) then 1 s steps: no ETA for the first steps, then the
    pace since step ETA_AFTER_STEPS, not 19 s per remaining step."""
    from fully_async.loggers import ETA_AFTER_STEPS

    now = [0.0]
    plain = ConsoleLogger(total_steps=500, start_step=0, clock=lambda: now[0])
    for step, t in enumerate([19.0, 20.0, 21.0, 22.0, 23.0, 24.0], start=1):
        now[0] = t
        plain.log(step, {"step": step})
        eta = plain.eta_s(step)
        assert math.isnan(eta) == (step <= ETA_AFTER_STEPS), step
    assert plain.eta_s(6) == pytest.approx(1.0 * (500 - 6))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("eta -") and lines[-1].endswith(f"eta {500 - 6}s")
