"""fully_async/job.py: the message a run fails with when a trainer node is lost (which node, which checkpoint, how
to continue). The loss itself is detected against Ray's node table in Job.run."""

from __future__ import annotations

from fully_async.job import trainer_lost_message


def test_trainer_lost_names_the_node_and_the_last_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_12").mkdir(parents=True)
    (root / "latest").write_text("step_12")
    node = "a1b2c3d4e5f6" * 4
    message = trainer_lost_message([node], {node: "10.0.0.7"}, root)
    assert "trainer node(s) lost: 10.0.0.7/a1b2c3d4" in message
    assert f"the last checkpoint is {root / 'step_12'}" in message
    assert "trainer.resume=auto" in message


def test_trainer_lost_before_any_checkpoint_says_so(tmp_path):
    message = trainer_lost_message(["ffff0000"], {}, tmp_path / "checkpoints")
    assert "?/ffff0000" in message and "no checkpoint was written yet" in message and "trainer.save_every" in message


def _remote_index_error():
    """A RayTaskError(IndexError) as Ray raises it in the driver for a task that failed in a worker: its message holds
    the worker's traceback."""
    import traceback

    from ray.exceptions import RayTaskError

    def write_the_weights():
        raise IndexError("index 28311552 is out of bounds for dimension 0 with size 28311552")

    try:
        write_the_weights()
    except IndexError as e:
        return RayTaskError("export_weights", traceback.format_exc(), e).as_instanceof_cause()


def test_a_failure_writes_its_whole_traceback_remote_part_included_into_the_runs_error_log(tmp_path):
    """Issue 48: a run that failed with RayTaskError(IndexError) left its traceback nowhere. record_failure appends
    the full chain to RUN_DIR/logs/error.log: the sync's error, what it wraps, the worker's remote frames, notes."""
    from fully_async.job import ERROR_LOG, record_failure
    from fully_async.weights.base import ParamSyncError

    remote = _remote_index_error()
    try:
        try:
            raise remote
        except Exception as e:
            failed = ParamSyncError("weight sync phase 'export' failed: IndexError: index 28311552 ...")
            failed.add_note("a note the run's log keeps")
            raise failed from e
    except ParamSyncError as e:
        path = record_failure(tmp_path, e)
    assert path == tmp_path / ERROR_LOG
    text = path.read_text()
    assert "the run failed: ParamSyncError" in text and "weight sync phase 'export' failed" in text
    assert "in write_the_weights" in text  # the worker's frame, from the remote traceback
    assert "RayTaskError(IndexError)" in text and "a note the run's log keeps" in text
    record_failure(tmp_path, RuntimeError("again"))  # a second failure (a resumed run) is appended
    assert path.read_text().startswith(text) and "RuntimeError: again" in path.read_text()
