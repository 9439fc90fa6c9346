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
