"""scripts/bench/offpolicy_sweep.py (the issue-35 staleness x correction grid) keeps a run of the same command that
logged every step, so the command goes on with a grid that spans sessions; a run cut off before its last step runs
again, and a command with other overrides never takes another command's runs as its own (runs are keyed by their
whole override set)."""

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
        sys.modules["offpolicy_sweep"] = module  # as a script is (__main__): its dataclass looks its module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_BENCH))
    return module


def _log_steps(run_dir: Path, steps: int) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in range(1, steps + 1)))


def test_a_run_is_finished_only_when_it_logged_every_step(sweep, tmp_path):
    (cell,) = sweep.cells([2], ["tis"], [0], 3, "background", [])
    assert not sweep.finished(cell, tmp_path)  # never started
    sweep.stamp(cell, tmp_path)
    run = cell.run_dir(tmp_path)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n\n')
    assert not sweep.finished(cell, tmp_path)  # cut off at step 2 (a blank line is no step)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert sweep.finished(cell, tmp_path)


def test_a_command_with_other_overrides_runs_its_own_and_tables_only_its_own(sweep, tmp_path):
    """The documented second command (verl's geometric bounds widened) must not reuse the first's runs: each run is
    keyed by its whole override set, in its directory's name and in its stamp, and a command's tables hold its runs
    only. The order the overrides are given in does not matter; the steps and every override do."""
    widen = ["algorithm.rollout_correction.rollout_rs_threshold='0.9_1.1'"]
    first = sweep.cells([2, 8], ["geo"], [0, 1], 20, "background", [])
    second = sweep.cells([2, 8], ["geo"], [0, 1], 20, "background", widen)
    for cell in first:  # the first command ran its grid to the end
        sweep.stamp(cell, tmp_path)
        _log_steps(cell.run_dir(tmp_path), 20)
    assert all(sweep.finished(c, tmp_path) for c in first)
    assert not any(sweep.finished(c, tmp_path) for c in second)  # all four are run again, with the wider bounds
    assert {c.run_dir(tmp_path) for c in first}.isdisjoint(c.run_dir(tmp_path) for c in second)
    assert all(o in c.overrides() for c in second for o in widen)
    # the same cell with its extra overrides in another order is the same run; with other steps it is not
    a, b = ["x.a=1", "x.b=2"], ["x.b=2", "x.a=1"]
    assert (
        sweep.Cell(2, "geo", 0, 4, "background", tuple(a)).key()
        == sweep.Cell(2, "geo", 0, 4, "background", tuple(b)).key()
    )
    assert not sweep.finished(sweep.Cell(2, "geo", 0, 21, "background"), tmp_path)
    # a directory whose stamp names other overrides is not this run, whatever its name says
    moved = second[0].run_dir(tmp_path)
    first[0].run_dir(tmp_path).rename(moved)
    assert not sweep.finished(second[0], tmp_path)
    # the rows of a command: its own finished runs, each read back as the cell its stamp records
    runs = sweep.finished_runs(first, tmp_path)
    assert runs == [c.run_dir(tmp_path) for c in first[1:]] and sweep.finished_runs(second, tmp_path) == []
    assert [sweep.recorded(r) for r in runs] == [
        {"staleness": c.staleness, "correction": "geo", "seed": c.seed} for c in first[1:]
    ]


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
