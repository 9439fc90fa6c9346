"""The real default job with async_training.sync_mode=background (vLLM-CPU, verl's FSDP2 engine at world size 1):
one short run at max_staleness=1, where syncs overlap training. The bound's other values run in background mode in
test_end_to_end.py (background is the default)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.integration.test_end_to_end import no_leaked_engines, read_jsonl, run  # noqa: F401 - the fixture is used

pytestmark = pytest.mark.slow


def test_background_sync_at_bound_one_keeps_the_bound_and_the_trainer_waits_for_the_export_only(tmp_path):
    proc = run(
        tmp_path, "trainer.total_steps=5", "async_training.max_staleness=1", "async_training.sync_mode=background"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 6))
    for m in metrics:
        # The trainer's part: the export, and (from step 2) the wait for the previous sync; the engines' phases of
        # the previous sync are reported by the step that collected them.
        assert "timing_s/param_sync/export" in m
        blocked = m["timing_s/param_sync"]
        assert blocked >= m["timing_s/param_sync/export"]
    later = metrics[1:-1]  # not the first (nothing to collect) nor the last (its checkpoint waits for its own sync)
    assert all("timing_s/param_sync/reload" in m and "timing_s/param_sync/wait" in m for m in later)
    # Apart from waiting for the previous sync, the trainer was held far less than the engines' phases took.
    held = sum(m["timing_s/param_sync"] - m["timing_s/param_sync/wait"] for m in later)
    assert held < sum(m["timing_s/param_sync/background"] for m in later) / 2, later
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert len(trajs) == 5 * 2 * 2
    assert all(t["trained_version"] - t["min_version"] <= 1 for t in trajs)
    assert all(t["min_version"] <= t["max_version"] <= t["trained_version"] for t in trajs)
    assert Counter((t["prompt_uid"], t["sample_index"]) for t in trajs).most_common(1)[0][1] == 1
