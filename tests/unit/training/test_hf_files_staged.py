"""A staged export's failure reaches the waiter whole: write_staged reports why through `D.failed`, written beside
it and renamed, so wait_for_staged (polling every millisecond) never reads a half-written reason."""

from __future__ import annotations

import pytest
import torch

from fully_async.training import hf_files


def test_a_failed_write_leaves_only_its_whole_reason_for_the_waiter(tmp_path):
    out = tmp_path / "v1"
    out.write_text("")  # a file where the directory should appear
    hf_files.write_staged([("w", torch.ones(2))], out, "float32", 1 << 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1", "v1.failed"]  # no partial note, no partial dir
    with pytest.raises(RuntimeError, match=r"writing the weights into .*v1 failed: \w+Error: "):
        hf_files.wait_for_staged(out, timeout_s=5)


def test_a_written_export_is_waited_for_and_holds_the_tensors(tmp_path):
    out = tmp_path / "v2"
    hf_files.write_staged([("w", torch.arange(4.0))], out, "float32", 1 << 20)
    hf_files.wait_for_staged(out, timeout_s=5)
    assert any(out.glob("*.safetensors")) and not (tmp_path / "v2.failed").exists()


def test_the_waiters_error_is_one_line_and_carries_the_writers_traceback_for_the_runs_log(tmp_path):
    """Issue 48: a staged write that failed in rank 0's thread reached the console as one line and nowhere with its
    traceback. The waiter's message stays one line; the writer's traceback rides along as a note, which
    job.record_failure writes into logs/error.log."""
    import traceback

    out = tmp_path / "v1"
    out.write_text("")
    hf_files.write_staged([("w", torch.ones(2))], out, "float32", 1 << 20)
    with pytest.raises(RuntimeError) as caught:
        hf_files.wait_for_staged(out, timeout_s=5)
    assert "\n" not in str(caught.value)
    full = "".join(traceback.format_exception(caught.value))
    assert "the writer's traceback" in full and "in write_staged" in full
