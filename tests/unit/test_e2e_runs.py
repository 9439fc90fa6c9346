"""scripts/bench/e2e_runs.py, which makes the issue-4 tables of docs/benchmarks.md, on run directories built here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from fully_async.data import synthetic_rows
from fully_async.protocol import PromptRef

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "e2e_runs.py"


@pytest.fixture(scope="module")
def e2e_runs():
    spec = importlib.util.spec_from_file_location("e2e_runs", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_run(root: Path, name: str, rewards: list[float], step_s: float, wrong_answer: str | None) -> Path:
    """A run of the copy task: per-step mean rewards as given; every trajectory of `wrong_answer` scores 0."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    data = {"train_files": [], "synthetic_size": 40, "seed": 3, "synthetic_task": "copy"}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"data": data}))
    metrics = [{"step": i + 1, "reward/mean": r, "timing_s/step": step_s} for i, r in enumerate(rewards)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    rows = synthetic_rows(40, 3, "train", "copy")
    trajectories = [
        {"prompt_uid": PromptRef(0, i).uid, "step": step, "reward": 0.0 if row.ground_truth == wrong_answer else 1.0}
        for step in range(1, len(rewards) + 1)
        for i, row in enumerate(rows)
    ]
    (run / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trajectories))
    return run


def test_levels_seconds_and_stuck_answers_come_from_the_run_files(tmp_path, e2e_runs):
    ramp = [min(1.0, i / 100) for i in range(200)]  # the 20-step mean first reaches 0.8 at step 91
    fast = e2e_runs.load(make_run(tmp_path, "x_eta1_s0", ramp, 0.5, wrong_answer=None))
    slow = e2e_runs.load(make_run(tmp_path, "x_eta0_s0", ramp, 1.0, wrong_answer="7"))
    assert e2e_runs.reached(fast, 0.8) == pytest.approx(45.5) and e2e_runs.reached(slow, 0.8) == pytest.approx(91.0)
    assert e2e_runs.reached(fast, 1.01) is None
    assert fast["last20"] == pytest.approx(1.0) and fast["seconds"] == pytest.approx(100.0)
    assert fast["stuck"] == [] and slow["stuck"] == ["7"]
    assert e2e_runs.mean_at(slow, 90.0) == pytest.approx(slow["means"][70]) and e2e_runs.mean_at(fast, 101.0) is None


def test_a_run_that_is_not_the_builtin_task_or_too_short_is_refused(tmp_path, e2e_runs):
    with pytest.raises(SystemExit, match="need at least 20"):
        e2e_runs.load(make_run(tmp_path, "short", [0.0] * 5, 1.0, None))
    run = make_run(tmp_path, "files", [0.0] * 30, 1.0, None)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"data": {"train_files": ["d.parquet"]}}))
    with pytest.raises(SystemExit, match="not the built-in task"):
        e2e_runs.load(run)
