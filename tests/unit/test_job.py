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
