"""`python -m fully_async.export`: which checkpoint it reads, and the errors for a directory or step that has none
(the export itself runs on real checkpoints in tests/integration/test_verl_backend.py and test_export_resume.py)."""

from __future__ import annotations

import json

import pytest

from fully_async.export import ExportError, find_checkpoint, main


def _checkpoint(run, step: int, complete: bool = True):
    backend = run / "checkpoints" / f"step_{step}" / "backend"
    backend.mkdir(parents=True)
    if complete:
        (backend / "fully_async_backend.json").write_text(json.dumps({"step": step, "world_size": 2}))
    return backend.parent


def test_the_latest_checkpoint_or_the_step_asked_for(tmp_path):
    first, second = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    (tmp_path / "checkpoints" / "latest").write_text("step_4")
    assert find_checkpoint(tmp_path) == second
    assert find_checkpoint(tmp_path, 2) == first


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("none", [], "is not a run directory with checkpoints"),
        ("steps", ["--step", "3"], r"no checkpoint for step 3 in .*; steps there: \[2, 4\]"),
        ("no_latest", [], r"has no checkpoint \(no 'latest'\); steps there: \[2\]"),
        ("half", ["--step", "2"], r"is not a complete checkpoint \(no backend/fully_async_backend.json\)"),
    ],
)
def test_a_directory_or_step_without_a_checkpoint_is_a_clear_error(tmp_path, capsys, setup, args, message):
    if setup == "steps":
        _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
        (tmp_path / "checkpoints" / "latest").write_text("step_4")
    elif setup == "no_latest":
        _checkpoint(tmp_path, 2)
    elif setup == "half":
        _checkpoint(tmp_path, 2, complete=False)
    with pytest.raises(ExportError, match=message):
        find_checkpoint(tmp_path, int(args[1]) if args else None)
    assert main([str(tmp_path), *args, "--out", str(tmp_path / "out")]) == 2
    assert "fully_async.export: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written
