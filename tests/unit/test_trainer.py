"""The trainer loop without Ray: the real MessageQueue in process (LocalActor), the simulated training backend, the
real ParamSync, and a stub rollouter at the edge (tests/fakes.py). The window arithmetic is checked on exact numbers,
the loop on what it logs, checkpoints on their atomicity and round trip."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from fully_async import trainer as trainer_mod
from fully_async.config import (
    AlgorithmConfig,
    AsyncTrainingConfig,
    FullyAsyncConfig,
    LoggerConfig,
    SimTrainerConfig,
    TrainerConfig,
)
from fully_async.handles import LocalActor, resolve
from fully_async.message_queue import MessageQueue
from fully_async.sync import ParamSync
from fully_async.trainer import Trainer, TrainerError, step_window
from fully_async.training.sim_backend import SimBackend
from tests.fakes import GATE_S, DiskFullBackend, StubRollouter
from tests.helpers import make_group


def _stats(t: float, busy: list[float], tokens: int = 0) -> dict:
    return {"time": t, "engine_busy_s": busy, "tokens": tokens, "groups_failed": 0, "reward_timeouts": 0}


def test_step_window_idle_ratios_are_shares_of_the_window():
    groups = [make_group(0, n=2, response_len=8), make_group(1, n=2, response_len=8)]  # 32 response tokens
    m = step_window(
        _stats(100.0, [10.0, 20.0], tokens=50),
        _stats(104.0, [12.0, 21.0], tokens=450),
        {"size": 3, "dropped_stale": 1},
        1.0,
        groups,
    )
    assert m["timing_s/step"] == pytest.approx(4.0)
    assert m["fully_async/trainer/idle_ratio"] == pytest.approx(0.25)  # waited 1 s of a 4 s window
    assert m["fully_async/rollouter/idle_ratio"] == pytest.approx(1 - 3.0 / (2 * 4.0))  # 3 busy s of 2 x 4 s
    assert m["perf/generated_tokens_per_s"] == pytest.approx(100.0)
    assert m["perf/tokens_per_s"] == pytest.approx(8.0)
    assert m["fully_async/queue/size"] == 3 and m["fully_async/count/dropped_stale"] == 1


def test_step_window_clips_to_the_unit_interval_and_counts_one_engine_at_least():
    m = step_window(_stats(0.0, []), _stats(2.0, []), {"size": 0, "dropped_stale": 0}, 5.0, [make_group(0)])
    assert m["fully_async/trainer/idle_ratio"] == 1.0  # a wait longer than the window (clock skew) is clipped
    assert m["fully_async/rollouter/idle_ratio"] == 1.0  # no engines reported: counted as one idle engine
    m = step_window(_stats(0.0, [0.0]), _stats(2.0, [3.0]), {"size": 0, "dropped_stale": 0}, 0.0, [make_group(0)])
    assert m["fully_async/rollouter/idle_ratio"] == 0.0 and m["fully_async/trainer/idle_ratio"] == 0.0


def _cfg(total_steps: int, sync_every: int = 1, save_every: int = 0) -> FullyAsyncConfig:
    return FullyAsyncConfig(
        async_training=AsyncTrainingConfig(groups_per_step=1, sync_every=sync_every, max_staleness=1),
        trainer=TrainerConfig(
            backend="sim",
            total_steps=total_steps,
            save_every=save_every,
            resume="auto",
            sim=SimTrainerConfig(time_scale=1e4),
        ),
        logger=LoggerConfig(backends=["jsonl"], trace=False),
    )


@pytest.fixture
def roles(tmp_path):
    """(queue handle, in-process queue, stub rollouter, its handle); the handles' threads are stopped after."""
    queue = MessageQueue(capacity=8, max_staleness=1)
    stub = StubRollouter(queue)
    q, r = LocalActor(queue, "queue"), LocalActor(stub, "rollouter")
    yield q, queue, stub, r
    q.close()
    r.close()


def _trainer(cfg, roles, tmp_path, backend=None, mode="blocking") -> Trainer:
    q, _, _, r = roles
    backend = backend or SimBackend(cfg.trainer, AlgorithmConfig())
    sync = ParamSync(r, backend, tmp_path / "weights", "float32", timeout_s=5.0, mode=mode)
    return Trainer(cfg, backend, q, r, sync, tmp_path / "run")


def test_a_starved_trainer_logs_its_waits_as_idle_and_syncs_every_step(roles, tmp_path):
    q, _, stub, _ = roles
    trainer = _trainer(_cfg(total_steps=2), roles, tmp_path)

    def produce():  # one group every 0.3 s: the trainer waits most of each step
        for i in range(2):
            time.sleep(0.3)
            resolve(q.put.remote([make_group(i)]))

    producer = threading.Thread(target=produce)
    producer.start()
    final = trainer.run()
    producer.join()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and [m["version"] for m in lines] == [0, 1]
    for m in lines:
        assert 0.5 < m["fully_async/trainer/idle_ratio"] <= 1.0
        assert m["timing_s/wait_for_batch"] > 0.15
        assert m["fully_async/rollouter/idle_ratio"] == pytest.approx(0.75, abs=0.05)  # the stub's busy share
        assert m["timing_s/param_sync"] > 0
    assert final["step"] == 2 and trainer.version == 2
    assert [c[0] for c in stub.calls] == ["pause", "load_weights", "resume"] * 2
    assert [c[2] for c in stub.calls if c[0] == "load_weights"] == [1, 2]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_2"  # the last step always saves


def test_filtered_groups_are_logged_once_with_the_step_that_read_them(roles, tmp_path):
    """One step_report() call per step hands over dynamic sampling's filtered groups; on a checkpoint step the
    snapshot hands over those it counts, and any filtered after it wait for the next step (a resume from the
    checkpoint generates them again), so no record is lost or logged twice."""
    q, _, stub, _ = roles
    trainer = _trainer(_cfg(total_steps=3, sync_every=10, save_every=2), roles, tmp_path)  # no sync: nothing stale
    for i in range(3):
        resolve(q.put.remote([make_group(i)]))
    prefetched = None
    for uid in ["a", "b", "c"]:
        stub.filtered.append({"prompt_uid": uid, "filtered": True})
        if uid == "b":  # step 2 saves: a group filtered while its checkpoint is written
            stub.filtered_after_snapshot.append({"prompt_uid": "late", "filtered": True})
        _, prefetched = trainer.train_step(prefetched)
    trainer.helpers.close()  # the writes handed over reach the file
    records = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    logged = [(r["prompt_uid"], r["step"]) for r in records if r.get("filtered")]
    assert logged == [("a", 1), ("b", 2), ("late", 3), ("c", 3)]


def test_the_trainer_fails_with_the_rollouters_error_instead_of_waiting(roles, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_mod, "POLL_S", 0.05)
    _, _, stub, _ = roles
    stub.error_message = "engine 0 died"
    trainer = _trainer(_cfg(total_steps=1), roles, tmp_path)
    with pytest.raises(TrainerError, match="the rollouter stopped: engine 0 died"):
        trainer.run()


def test_a_checkpoint_that_fails_halfway_leaves_the_previous_one_current(roles, tmp_path):
    cfg = _cfg(total_steps=4)
    trainer = _trainer(cfg, roles, tmp_path)
    trainer.step, trainer.version = 1, 1
    first = trainer.save()
    ckpts = tmp_path / "run" / "checkpoints"
    assert first == ckpts / "step_1" and (ckpts / "latest").read_text() == "step_1"

    broken = _trainer(cfg, roles, tmp_path, backend=DiskFullBackend(cfg.trainer, AlgorithmConfig()))
    broken.step, broken.version = 2, 2
    with pytest.raises(OSError, match="No space left"):
        broken.save()
    assert not (ckpts / "step_2").exists()  # no half checkpoint under a real name
    assert (ckpts / "latest").read_text() == "step_1"
    assert broken.find_checkpoint() == ckpts / "step_1"

    trainer.step, trainer.version = 2, 2
    assert trainer.save() == ckpts / "step_2"  # the leftover temporary directory does not get in the way
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_1", "step_2"]
    assert not (ckpts / "step_2" / "backend" / "half_written.bin").exists()


def test_a_checkpoint_round_trip_restores_step_version_and_queue(roles, tmp_path):
    q, queue, _, _ = roles
    cfg = _cfg(total_steps=4)
    resolve(q.put.remote([make_group(5), make_group(6)]))
    trainer = _trainer(cfg, roles, tmp_path)
    trainer.step, trainer.version = 3, 2
    path = trainer.save()
    resolve(q.get.remote(2, 0))  # the queue moves on after the checkpoint
    assert queue.size() == 0

    resumed = _trainer(cfg, roles, tmp_path)
    assert resumed.find_checkpoint() == path
    start = resumed.restore(path)
    assert (resumed.step, resumed.version) == (3, 2)
    assert queue.size() == 2 and [g.prompt.index for _, g in queue._items] == [5, 6]
    assert start == {"cursor_state": {"epoch": 0}, "ledger_state": {"version": 0}}


@pytest.mark.parametrize("save_hf", [True, False])
def test_the_last_checkpoint_holds_the_model_in_hugging_face_format(roles, tmp_path, save_hf):
    import dataclasses

    cfg = _cfg(total_steps=3)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, save_hf=save_hf))
    trainer = _trainer(cfg, roles, tmp_path)
    trainer.step = 2
    assert not (trainer.save() / "hf").exists()  # only the run's end: every checkpoint can be exported later
    trainer.step = 3
    hf = trainer.save() / "hf"
    assert hf.is_dir() == save_hf
    if save_hf:  # the simulated backend's stand-in for the weights, in the engine's dtype
        assert json.loads((hf / "sim_weights.json").read_text())["dtype"] == "float32"


# ---- async_training.sync_mode=background ----------------------------------------------------------------------------
def test_background_a_checkpoint_waits_for_the_sync_so_engines_and_trainer_agree_on_the_version(roles, tmp_path):
    q, _, stub, _ = roles
    stub.delays["load_weights"] = 0.3  # still reloading when the step reaches its checkpoint
    for i in range(2):
        resolve(q.put.remote([make_group(i)]))
    trainer = _trainer(_cfg(total_steps=2, save_every=1), roles, tmp_path, mode="background")
    trainer.run()
    for step in (1, 2):
        state = json.loads((tmp_path / "run" / "checkpoints" / f"step_{step}" / "state.json").read_text())
        assert state["version"] == state["ledger"]["version"] == step
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for m in lines:  # the wait is the trainer's, the reload happened behind it
        assert m["timing_s/param_sync/wait"] > 0.2 and m["timing_s/param_sync"] >= m["timing_s/param_sync/wait"]


def test_the_last_step_logs_the_validation_of_the_weights_the_run_ends_with(roles, tmp_path):
    """With trainer.val_every set, the last step waits for its (background) sync, then for the rollouter's final
    validation, and logs its result on that step; without it, no final validation is asked for."""
    q, _, stub, _ = roles
    stub.delays["load_weights"] = 0.3  # still reloading when the last step asks
    stub.final_results = [{"version": 2, "val/reward_mean": 0.75, "val/n": 4}]
    for i in range(4):
        resolve(q.put.remote([make_group(i)]))
    cfg = _cfg(total_steps=2)
    cfg.trainer.val_every = 5  # never reached by 2 steps: the final validation is the only one
    _trainer(cfg, roles, tmp_path, mode="background").run()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "val/reward_mean" not in lines[0]
    assert (lines[1]["val/reward_mean"], lines[1]["val/n"], lines[1]["val/version"]) == (0.75, 4, 2)
    names = [c[0] for c in stub.calls]
    assert names[-1] == "final_validation" and names[-2] == "resume"  # after the last sync finished
    stub.calls.clear()
    _trainer(_cfg(total_steps=2), roles, tmp_path / "again", mode="background").run()  # val_every=0
    assert "final_validation" not in [c[0] for c in stub.calls]


def test_a_final_validation_that_never_answers_fails_the_run_naming_it(roles, tmp_path):
    q, _, stub, _ = roles
    stub.gates["final_validation"] = threading.Event()  # never opened: the held-out requests never come back
    for i in range(2):
        resolve(q.put.remote([make_group(i)]))
    cfg = _cfg(total_steps=2)
    cfg.trainer.val_every, cfg.trainer.call_timeout_s = 5, 0.3
    start = time.monotonic()
    with pytest.raises(TrainerError, match=r"final validation did not finish within trainer.call_timeout_s=0.3 s"):
        _trainer(cfg, roles, tmp_path).run()
    assert time.monotonic() - start < GATE_S / 2  # the trainer's bound ended the wait, not the stub's gate
    stub.gates["final_validation"].set()


def test_background_a_reload_that_fails_fails_the_run_naming_the_phase_while_the_trainer_waits(
    roles, tmp_path, monkeypatch
):
    from fully_async.sync import ParamSyncError

    monkeypatch.setattr(trainer_mod, "POLL_S", 0.05)
    q, _, stub, _ = roles
    stub.fail["load_weights"] = RuntimeError("HTTP 500")  # the engines stay paused: no second batch ever comes
    resolve(q.put.remote([make_group(0)]))
    cfg = _cfg(total_steps=3)
    cfg.advanced.get_timeout_s = 5.0
    trainer = _trainer(cfg, roles, tmp_path, mode="background")
    start = time.monotonic()
    with pytest.raises(ParamSyncError, match="background sync of version 1: weight sync phase 'reload' failed"):
        trainer.run()
    # Raised by the check while it waits for a batch, not after the batch wait's own deadline (get_timeout_s).
    assert time.monotonic() - start < cfg.advanced.get_timeout_s and trainer.step == 1


class _SlowExport(SimBackend):
    """Export takes EXPORT_S and reads the backend's step only at its end, as a real export reads the parameters
    while it writes them."""

    EXPORT_S = 0.3

    def export_weights(self, out_dir, dtype="float32", *, sync=False):
        time.sleep(self.EXPORT_S)
        return super().export_weights(out_dir, dtype)


def test_background_the_export_overlaps_the_step_and_the_next_update_waits_until_the_weights_were_read(roles, tmp_path):
    q, _, stub, _ = roles
    for i in range(2):
        resolve(q.put.remote([make_group(i)]))
    cfg = _cfg(total_steps=2)
    trainer = _trainer(cfg, roles, tmp_path, backend=_SlowExport(cfg.trainer, AlgorithmConfig()), mode="background")
    trainer.run()
    # Each version's files hold the weights of the update that made it, not those of the update after it.
    for v in (1, 2):
        assert json.loads((tmp_path / "weights" / f"v{v}" / "sim_weights.json").read_text())["step"] == v
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Step 1 started the sync of v1 and went on; step 2's update waited for its export (reported there).
    assert lines[0]["timing_s/param_sync"] < _SlowExport.EXPORT_S / 2 and "timing_s/param_sync/export" not in lines[0]
    assert lines[1]["timing_s/param_sync/export"] >= _SlowExport.EXPORT_S
    assert lines[1]["timing_s/param_sync"] >= _SlowExport.EXPORT_S * 0.8


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose every write fails)")
def test_a_write_that_fails_in_the_writer_thread_fails_the_run(roles, tmp_path):
    """The trajectory records are written in the trainer's writer thread while the update computes: a write that
    fails (here into /dev/full: no space left) still fails the run, at the trainer's next hand-over."""
    q, _, _, _ = roles
    for i in range(6):
        resolve(q.put.remote([make_group(i)]))
    trainer = _trainer(_cfg(total_steps=6, sync_every=10), roles, tmp_path)
    (tmp_path / "run").mkdir(parents=True)
    (tmp_path / "run" / "trajectories.jsonl").symlink_to("/dev/full")
    with pytest.raises(OSError, match="No space left"):
        trainer.run()
    assert trainer.step <= 3  # raised by a hand-over soon after, not only when the file is closed at the end
