"""The Rollouter in process, without Ray: emulated engines (engine=sim), the sim agent loop and reward, and a real
MessageQueue behind a LocalActor; the test plays the trainer (gets batches, syncs weights). Admission stays within
its rule while groups are produced, every prompt of an epoch comes out exactly once as a whole group, a group the
queue drops as stale is generated again, and step_report() hands the trainer stats, filtered groups and validation
in one call."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import pytest

from fully_async.config import compose, to_dict
from fully_async.handles import LocalActor, resolve_async
from fully_async.message_queue import MessageQueue
from fully_async.models import resolve_model_path
from fully_async.rollouter import Rollouter
from tests.helpers import SIM_ROLLOUT

pytestmark = pytest.mark.timeout(120)

SIM = [*SIM_ROLLOUT, "engine.num_servers=2", "async_training.sync_every=1"]


@contextlib.asynccontextmanager
async def running(tmp_path, overrides: list[str]):
    """(the started Rollouter, a call helper for its queue); shut down and the queue's thread stopped after."""
    cfg = compose([*SIM, *overrides])
    at = cfg.async_training
    handle = LocalActor(MessageQueue(at.effective_queue_capacity(), at.max_staleness), "queue")
    rollouter = Rollouter(to_dict(cfg), str(resolve_model_path(cfg.model)), str(tmp_path), handle)

    def queue(method: str, *args):
        return resolve_async(getattr(handle, method).remote(*args))

    try:
        await rollouter.start()
        yield rollouter, queue
        assert rollouter.error() is None
    finally:
        await rollouter.shutdown()
        handle.close()


async def until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def sync(rollouter: Rollouter, tmp_path, version: int) -> None:
    """What ParamSync does: pause, load the weights as `version`, resume."""
    await rollouter.pause()
    await rollouter.engine("load_weights", str(tmp_path), version)
    await rollouter.resume()


async def test_admission_keeps_its_rule_and_each_prompt_of_an_epoch_comes_out_once_as_a_whole_group(tmp_path):
    # eta=1, 4 groups a version: 8 groups may exist at version 0, and the dataset has 8 prompts. The start window
    # (4 samples: one group) holds until 4 groups are pushed, then max_concurrent (8 samples: two groups) alone.
    overrides = ["async_training.max_staleness=1", "async_training.groups_per_step=4", "data.synthetic_size=8",
                 "rollout.max_concurrent=8", "rollout.start_concurrent=4"]  # fmt: skip
    async with running(tmp_path, overrides) as (rollouter, queue):
        seen: list[tuple[int, int, int, int]] = []  # (admitted and not dropped, running, in flight, pushed)
        while (s := rollouter.stats())["ledger/accepted"] < 8:
            seen.append((s["ledger/accepted"] + s["ledger/running"], s["ledger/running"], s["inflight_samples"],
                         s["groups_pushed"]))  # fmt: skip
            assert len(seen) < 30_000, s
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.3)  # the admission loop has looked again: nothing more fits at version 0
        last = rollouter.stats()
        groups = await queue("get", 8, 0, 5)
    assert max(a for a, _, _, _ in seen) <= 8 and max(f for _, _, f, _ in seen) <= 8
    assert max(r for _, r, _, p in seen if p < 4) == 1  # the start window: one group at a time
    assert max(r for _, r, _, p in seen if p >= 4) >= 2  # then it opens
    assert last["ledger/running"] == 0 and last["ledger/accepted"] == 8 and last["groups_pushed"] == 8
    assert sorted(g.prompt.uid for g in groups) == [f"0:{i}" for i in range(8)]
    for g in groups:
        assert sorted(t.sample_index for t in g.trajectories) == [0, 1, 2, 3]
        assert {t.prompt for t in g.trajectories} == {g.prompt}


async def test_a_group_the_queue_drops_as_stale_is_generated_again(tmp_path):
    # eta=0: the 4 groups made at version 0 are too old to train at version 1.
    overrides = ["async_training.max_staleness=0", "async_training.groups_per_step=4", "data.synthetic_size=16",
                 "data.shuffle=false"]  # fmt: skip
    async with running(tmp_path, overrides) as (rollouter, queue):
        await until(lambda: rollouter.ledger.accepted == 4, "version 0's groups")
        await sync(rollouter, tmp_path, 1)
        groups = await queue("get", 4, 1, 30) + await queue("get", 4, 1, 30)  # the first drops version 0's groups
        stats = rollouter.stats()
    assert sorted(g.prompt.uid for g in groups) == sorted(f"0:{i}" for i in range(8))  # each prompt once
    again = [g for g in groups if g.prompt.index < 4]  # the dropped prompts, re-issued at version 1
    assert len(again) == 4 and all(t.min_version == 1 for g in again for t in g.trajectories)
    assert stats["ledger/dropped_stale"] == 4 and stats["ledger/reissued"] == 4


async def test_step_report_hands_the_trainer_stats_filtered_groups_and_validation_in_one_call(tmp_path):
    # Every sample the same length: every reward equal, so dynamic sampling filters every group (and frees its slot).
    overrides = ["engine.sim.length_sigma=0", "algorithm.filter_groups.enable=true", "trainer.val_every=1",
                 "async_training.groups_per_step=2", "data.synthetic_size=64"]  # fmt: skip
    async with running(tmp_path, overrides) as (rollouter, queue):
        await until(lambda: rollouter.ledger.filtered >= 3, "filtered groups")
        kept = rollouter.step_report(take_filtered=False)
        report = rollouter.step_report()
        await sync(rollouter, tmp_path, 1)  # validation runs at each version val_every divides
        later = []
        while not (validation := [v for r in later for v in r["validation"]]):
            assert len(later) < 3000, "no validation result"
            later.append(rollouter.step_report())
            await asyncio.sleep(0.01)
    assert kept["filtered"] == [] and kept["stats"]["groups_filtered"] >= 3
    assert len(report["filtered"]) >= 3 * 4 and all(r["filtered"] for r in report["filtered"])
    assert report["stats"]["groups_pushed"] == 0 and report["validation"] == []
    assert [v["version"] for v in validation] == [1] and validation[0]["val/n"] == 32
    records = [(r["prompt_uid"], r["sample_index"]) for x in [report, *later] for r in x["filtered"]]
    assert len(records) == len(set(records))  # each filtered group's records handed over once


async def test_validation_samples_as_rollout_val_says_and_can_run_before_training(tmp_path):
    """verl's val_kwargs and val_before_train: validation at the starting version without a sync, rollout.val.n
    responses per held-out prompt, greedy when do_sample is false (the training rollouts keep their sampling)."""
    overrides = ["trainer.val_every=1", "trainer.val_before_train=true", "rollout.val.n=3", "rollout.val.do_sample=false",
                 "rollout.temperature=0.9", "data.synthetic_size=64"]  # fmt: skip
    async with running(tmp_path, overrides) as (rollouter, _):
        assert (rollouter.validation.agent.sampling.temperature, rollouter.agent.sampling.temperature) == (0.0, 0.9)
        validation = []
        for _ in range(3000):  # no sync ever happens: only val_before_train validates
            validation += rollouter.step_report()["validation"]
            if validation:
                break
            await asyncio.sleep(0.01)
    assert [v["version"] for v in validation] == [0] and validation[0]["val/n"] == 3 * 32


async def test_final_validation_validates_the_last_version_once_whatever_val_every_says(tmp_path):
    """The trainer's last step: the engines' current version is validated (val_every=3 never reaches version 2),
    the result is returned with the earlier one not yet popped, admission stops, and a second call at the same
    version starts nothing new."""
    overrides = ["trainer.val_every=3", "trainer.val_before_train=true", "data.synthetic_size=64"]
    async with running(tmp_path, overrides) as (rollouter, _):
        await sync(rollouter, tmp_path, 1)
        await sync(rollouter, tmp_path, 2)  # no validation at 1 or 2: val_every=3
        results = await rollouter.final_validation()
        admitting = rollouter._admitting.is_set()
        again = await rollouter.final_validation()
    assert [v["version"] for v in results] == [0, 2] and results[-1]["val/n"] == 32
    assert not admitting and again == []


def test_validation_sampling_takes_the_rollouts_values_it_does_not_set():
    from fully_async.engines import Sampling

    ro = compose(["rollout.temperature=0.9", "rollout.top_k=20", "rollout.val.top_p=0.7"]).rollout
    assert Sampling.for_validation(ro, stop_token_ids=(2,)) == Sampling(0.9, 0.7, 20, stop_token_ids=(2,))
    ro = compose(["rollout.val.temperature=0.5", "rollout.val.do_sample=false"]).rollout
    assert Sampling.for_validation(ro) == Sampling(0.0, 1.0, -1)


def test_before_start_every_field_is_set_and_rays_thread_call_warning_is_off(tmp_path, monkeypatch):
    """stats() answers before start() (the job polls it early); the Rollouter turns off Ray's warning about ray.get in
    an async actor, which its worker-thread calls to engine hosts set off, unless the user set it."""
    from fully_async.production import COUNTERS
    from fully_async.rollouter import RAY_GET_WARNING_ENV

    cfg = compose(SIM)
    monkeypatch.delenv(RAY_GET_WARNING_ENV, raising=False)
    rollouter = Rollouter(to_dict(cfg), str(resolve_model_path(cfg.model)), str(tmp_path), None)
    stats = rollouter.stats()
    assert {k: stats[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0) and stats["inflight_samples"] == 0
    assert stats["client"] == {} and stats["engine_busy_s"] == [] and stats["pool"] == {}
    assert rollouter.step_report()["filtered"] == [] and rollouter.error() is None
    assert os.environ[RAY_GET_WARNING_ENV] == "0"
    monkeypatch.setenv(RAY_GET_WARNING_ENV, "1")
    Rollouter(to_dict(cfg), str(resolve_model_path(cfg.model)), str(tmp_path), None)
    assert os.environ[RAY_GET_WARNING_ENV] == "1"


async def test_a_request_that_exhausts_its_retries_reads_the_server_log_off_the_event_loop(monkeypatch):
    """The error message carries the server's log tail; for a server on an engine host that read is a blocking Ray
    call, so it runs in a worker thread, never on the Rollouter's event loop."""
    from fully_async.config import EngineConfig
    from fully_async.engines import EngineClient, EngineError, build_engine

    dead = ["http://127.0.0.1:9"]  # nothing listens there: the request fails at once
    servers = build_engine(EngineConfig(control_timeout_s=5.0, max_retries=0), "/nonexistent", "/tmp", addresses=dead)
    threads: list[threading.Thread] = []
    read = servers.log_tail

    def log_tail(index: int, lines: int = 40) -> str:
        threads.append(threading.current_thread())
        return read(index, lines)

    monkeypatch.setattr(servers, "log_tail", log_tail)
    client = EngineClient(servers)
    try:
        with pytest.raises(EngineError, match="generate failed 1 times"):
            await client.generate([1], 4)
    finally:
        await client.close()
    assert threads and threads[0] is not threading.current_thread()


async def test_a_sync_pauses_no_idle_server_and_lets_the_trainers_next_batch_finish_for_up_to_the_last_hold(tmp_path):
    # eta=1, 4 groups a step: 8 groups fit at version 0, 4 more at version 1 (the trainer's next batch at the sync of
    # version 2). 20-token samples at 10 ms a token: a group is in flight for about 0.2 s.
    overrides = ["async_training.max_staleness=1", "async_training.groups_per_step=4", "data.synthetic_size=64",
                 "engine.sim.decode_step_s=0.01"]  # fmt: skip
    async with running(tmp_path, overrides) as (rollouter, queue):
        client, state = rollouter.client, rollouter.servers.state
        await until(lambda: rollouter.ledger.accepted == 8 and client.idle(), "version 0's groups")
        await rollouter.pause()  # nothing in flight: the servers are not paused, only the client holds
        assert state.paused and state.clients_only
        await rollouter.engine("load_weights", str(tmp_path), 1)
        await rollouter.resume()
        assert not state.paused and not state.clients_only
        for _ in range(2):  # the trainer takes version 0's groups: the queue has room for what comes next
            await queue("get", 4, 1, 5)
        # Version 1's groups are in flight when the next sync begins: with a long last hold they finish first.
        await until(lambda: not client.idle(), "version 1's groups in flight")
        rollouter._last_hold_s, aborts = 30.0, client.stats.aborts
        start = time.monotonic()
        await rollouter.pause()
        assert client.idle() and client.stats.aborts == aborts and state.clients_only  # finished, not aborted
        assert time.monotonic() - start < 5.0  # until the batch was in, not the whole bound
        await rollouter.engine("load_weights", str(tmp_path), 2)
        await rollouter.resume()
        # With no hold to spare (the first sync's case) a request in flight is aborted and the servers paused.
        await until(lambda: not client.idle(), "version 2's groups in flight")
        rollouter._last_hold_s = 0.0
        await rollouter.pause()
        assert not state.clients_only
        await asyncio.sleep(0.05)
        await rollouter.engine("load_weights", str(tmp_path), 3)
        await rollouter.resume()
        await until(lambda: client.stats.aborts > aborts, "the aborted requests to come back")
