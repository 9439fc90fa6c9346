"""A vision-language job killed mid-run and resumed (task=colors, docs/vlm.md): the queue's checkpoint brings back
image trajectories generated before the kill, the resumed trainer trains them, the resumed engine's samples agree
with the trainer at staleness 0, and every prompt of the epoch is trained once. ~600 s measured. Two job starts of a VLM on a loaded 2-core box: marked long (deselected by default)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import Counter

import pytest

from tests.integration.test_end_to_end import REPO, command, env, read_jsonl, run

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_a_colors_run_sigkilled_then_resumed_trains_its_queued_image_groups_and_every_prompt_once(tmp_path):
    prompts, n = 12, 2
    args = ["task=colors", f"data.synthetic_size={prompts}", "trainer.total_steps=9", "trainer.save_every=2",
            "trainer.resume=auto", "engine.control_deadline_s=60"]  # fmt: skip
    proc = subprocess.Popen(
        command(tmp_path, *args), cwd=REPO, env=env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(read_jsonl(metrics)) >= 5:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    checkpoint = int((tmp_path / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert checkpoint in (4, 6)

    resumed = run(tmp_path, *args, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    found = re.search(rf"at step {checkpoint}, version {checkpoint}, (\d+) queued groups", resumed.stdout)
    assert found and int(found.group(1)) >= 1, resumed.stdout[-2000:]  # image groups came back from the checkpoint
    steps = read_jsonl(metrics)
    assert [m["step"] for m in steps] == list(range(1, 10))
    # The resumed engine serves the checkpoint's weights and gets the images: where the resumed trainer scored tokens
    # of its own version (staleness 0), its log-probs are the engine's (measured: 2 such tokens, gap 0.0).
    fresh = [m for m in steps[checkpoint:] if m.get("offpolicy/staleness_0/tokens", 0) > 0]
    assert fresh and all(m["offpolicy/staleness_0/abs_diff"] < 1e-4 for m in fresh), fresh
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert all(0 <= t["trained_version"] - t["min_version"] <= 1 for t in trajs)
    # The queue's groups were generated before the kill, by versions before the checkpoint's (measured: 2 groups of
    # version 3 trained at step 5 after the checkpoint of step 4). They are trained one version behind, so their
    # images are not proven by a log-prob gap here; their encoding is (tests/unit/multimodal).
    assert [t for t in trajs if t["step"] > checkpoint and t["min_version"] < checkpoint]
    keys = Counter((t["epoch"], t["prompt_uid"], t["sample_index"]) for t in trajs)
    assert max(keys.values()) == 1, "a sample was trained twice"
    per_prompt = Counter(t["prompt_uid"] for t in trajs if t["epoch"] == 0)
    assert sorted(per_prompt) == sorted(f"0:{i}" for i in range(prompts)), "a prompt of the epoch was lost"
    assert set(per_prompt.values()) == {n}
