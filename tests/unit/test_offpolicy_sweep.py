"""scripts/bench/offpolicy_sweep.py (the issue-35 staleness x correction grid) keeps a cell whose run logged every
step, so the same command goes on with a grid that spans sessions; a run cut off before its last step runs again."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


@pytest.fixture(scope="module")
def sweep():
    sys.path.insert(0, str(_BENCH))  # the script imports background_sync.py beside it, as it does when run
    try:
        spec = importlib.util.spec_from_file_location("offpolicy_sweep", _BENCH / "offpolicy_sweep.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_BENCH))
    return module


def test_a_run_is_finished_only_when_it_logged_every_step(sweep, tmp_path):
    run = tmp_path / "s2_tis_seed0"
    assert not sweep.finished(run, 3)  # never started
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n\n')
    assert not sweep.finished(run, 3)  # cut off at step 2 (a blank line is no step)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert sweep.finished(run, 3)


def test_the_tables_show_the_staleness_a_run_trained_at_not_only_its_bound(sweep, tmp_path):
    """max_staleness is a ceiling: the per-run and per-cell tables carry the trained tokens' mean and largest
    staleness, read from the run's metrics (a run that never came near its bound must not read as one that did)."""
    import json

    run = tmp_path / "s8_tis_seed0"
    run.mkdir()
    steps = [{"step": i, "staleness/token_mean": m, "staleness/token_max": x, "offpolicy/k3": 0.01}
             for i, (m, x) in enumerate([(0.0, 0), (1.0, 2), (2.0, 7)], 1)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    got = sweep.offpolicy(run)
    assert got["token_staleness"] == pytest.approx(1.0) and got["token_staleness_max"] == 7
    row = {
        "name": run.name,
        "steps": 3,
        "last20": 0.5,
        "reached": None,
        "step_s": 1.0,
        **got,
        "staleness": 8,
        "correction": "tis",
        "token_staleness": 8 / 3,
    }
    per_run, summary = sweep.tables([row, {**row, "token_staleness_max": 3, "token_staleness": 1 / 3}]).split("\n\n")
    assert "token staleness: mean (max)" in per_run.splitlines()[0] and "| 2.67 (7) |" in per_run
    assert "| 1.50 (7) |" in summary  # the cell: mean over its runs, the largest of any run


@pytest.mark.parametrize("staleness", [0, 2, 8])
def test_every_correction_of_the_sweep_is_a_valid_run_at_every_staleness(sweep, staleness):
    """Each cell's overrides pass the config's validation (the fail-closed rule included) as the runner would see
    them; the uncorrected cell gets through only by its explicit opt-out, so the rule is what it measures."""
    from fully_async.config import ConfigError, compose

    for name, overrides in sweep.CORRECTIONS.items():
        config = compose(["task=reverse", f"async_training.max_staleness={staleness}", *overrides])
        assert config.algorithm.rollout_correction.preset in {o.split("=")[1] for o in overrides}, name
    if staleness:
        opted_out = [o for o in sweep.CORRECTIONS["none"] if "allow_uncorrected" not in o]
        with pytest.raises(ConfigError, match="corrects nothing|allow_uncorrected"):
            compose(["task=reverse", f"async_training.max_staleness={staleness}", *opted_out])
