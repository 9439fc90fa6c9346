"""A failed run's traceback goes to a file of the run (issue 48: a RayTaskError(IndexError) left it nowhere): the
console keeps its one FAILED line, which names RUN_DIR/logs/error.log, and that file holds the whole traceback, the
Ray task's remote frames included. A simulated run (engine=sim, trainer=sim) whose transport fails in a Ray task."""

from __future__ import annotations

import pytest

from tests.failing_transport import TRANSPORT
from tests.integration.test_end_to_end import run

pytestmark = pytest.mark.timeout(300)


def test_a_run_that_fails_in_a_ray_task_prints_one_line_and_logs_the_remote_traceback(tmp_path):
    proc = run(tmp_path, "engine=sim", "trainer=sim", "trainer.total_steps=2", "trainer.sim.optimizer_step_s=0.05",
               f"async_training.weight_transport={TRANSPORT}", timeout=240)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    failed = [line for line in proc.stderr.splitlines() if "FAILED" in line]
    log = tmp_path / "logs" / "error.log"
    assert len(failed) == 1 and failed[0].endswith(f"(traceback: {log})"), proc.stderr[-3000:]
    # The one line names what failed in the task: the remote error, not the RayTaskError's `ray::task() (pid=...)`.
    assert "ParamSyncError" in failed[0] and "IndexError: index 1 is out of bounds" in failed[0], failed[0]
    assert "Traceback" not in proc.stderr  # the console keeps its one line
    text = log.read_text()
    assert "weight sync phase 'export' failed" in text and "RayTaskError(IndexError)" in text
    assert "in write_the_weights" in text  # the task's own frame, from the worker
    assert "IndexError: index 1 is out of bounds" in text
