"""Admission alone (fully_async/admission.py), without Ray or engines: the rule (staleness bound, max_concurrent, start
window, pause), which prompt comes next, how production's outcomes settle in the ledger, and the stale drops taken from
a real in-process MessageQueue (LocalActor)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fully_async.admission import STALE_POLL_S, Admission
from fully_async.data import EpochCursor
from fully_async.handles import LocalActor, resolve_async
from fully_async.message_queue import MessageQueue, QueueTimeout
from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup
from fully_async.staleness import StalenessLedger

pytestmark = pytest.mark.timeout(60)
N = 4


def make(eta=1, per_version=4, max_concurrent=64, start_concurrent=64, per_step=1, queue=None, rows=16) -> Admission:
    adm = Admission(StalenessLedger(eta, per_version), queue, asyncio.Lock(), N, max_concurrent, start_concurrent,
                    per_step)  # fmt: skip
    adm.cursor = EpochCursor(rows, seed=0, shuffle=False)
    adm.admitting.set()
    return adm


def test_the_staleness_bound_caps_admission():
    adm = make(eta=1, per_version=4)  # (1 + 0 + 1) * 4 groups at version 0
    admitted = []
    while adm.may_admit(0, groups_pushed=10):
        admitted.append(adm.admit_next())
    assert len(admitted) == 8 == adm.ledger.capacity
    adm.ledger.on_sync(1)
    assert adm.may_admit(0, 10) and adm.ledger.headroom() == 4


def test_max_concurrent_counts_samples_and_lets_a_group_larger_than_it_in_alone():
    adm = make(max_concurrent=8)
    assert adm.may_admit(inflight_samples=4, groups_pushed=10)  # 4 + 4 <= 8
    assert not adm.may_admit(inflight_samples=5, groups_pushed=10)
    small = make(max_concurrent=2)  # below rollout.n: one whole group at a time
    assert small.may_admit(0, 10) and not small.may_admit(1, 10)


def test_the_start_window_holds_until_a_steps_groups_are_pushed():
    adm = make(eta=3, start_concurrent=8, per_step=2)  # two groups (8 samples) until 2 groups were pushed
    first = [adm.admit_next() for _ in range(2)]
    assert not adm.may_admit(0, groups_pushed=1)
    assert adm.may_admit(0, groups_pushed=2)
    adm.pushed(first[:1])  # a group finished: its slot in the window is free again before the step is out
    assert adm.may_admit(0, groups_pushed=1)


def test_a_paused_admission_admits_nothing():
    adm = make()
    adm.admitting.clear()
    assert not adm.may_admit(0, 0)


def test_reissued_prompts_come_before_the_cursor():
    adm = make()
    a, b = adm.admit_next(), adm.admit_next()
    assert (a, b) == (PromptRef(0, 0), PromptRef(0, 1))
    adm.failed(a)
    assert adm.admit_next() == a and adm.admit_next() == PromptRef(0, 2)


def test_outcomes_settle_in_the_ledger_and_wake_the_loop():
    adm = make()
    p = [adm.admit_next() for _ in range(4)]
    adm.pushed(p[:2])
    assert adm.wake.is_set() and adm.ledger.accepted == 2 and len(adm.ledger.running) == 2
    adm.wake.clear()
    adm.failed(p[2])
    assert adm.wake.is_set() and list(adm.ledger.reissue) == [p[2]] and adm.ledger.failed == 1
    adm.wake.clear()
    adm.filtered(p[3], reissue=False)
    assert adm.wake.is_set() and not adm.ledger.running and adm.ledger.filtered == 1
    assert list(adm.ledger.reissue) == [p[2]] and adm.ledger.accepted == 2  # filtered: neither accepted nor back


def group(prompt: PromptRef, version: int) -> TrajectoryGroup:
    t = Trajectory(prompt, 0, np.array([1]), np.array([2]), np.array([0.0]), np.array([version]))
    return TrajectoryGroup(prompt, [t])


async def test_stale_drops_are_taken_from_the_queue_and_reissued():
    handle = LocalActor(MessageQueue(capacity=16, max_staleness=0), "queue")

    def call(method: str, *args):
        return resolve_async(getattr(handle, method).remote(*args))

    async def push_and_drop(adm: Admission, count: int, trainer_version: int) -> list[PromptRef]:
        """Admit `count` groups, push them at the ledger's version and let a get at `trainer_version` drop them."""
        prompts = [adm.admit_next() for _ in range(count)]
        await call("put", [group(p, adm.ledger.version) for p in prompts])
        adm.pushed(prompts)
        with pytest.raises(QueueTimeout):  # every queued group is stale there: dropped, none to get
            await call("get", 1, trainer_version, 0.05)
        return prompts

    try:
        adm = make(eta=0, per_version=2, queue=handle)
        prompts = await push_and_drop(adm, 2, trainer_version=1)
        assert not adm.ledger.reissue and adm.ledger.accepted == 2  # not taken yet
        await adm.pull_stale_drops()
        assert list(adm.ledger.reissue) == prompts and adm.ledger.accepted == 0 and adm.ledger.dropped_stale == 2
        assert adm.admit_next() == prompts[0]  # re-issued before the cursor's next
        # Polled at most every STALE_POLL_S: a drop right after the last poll waits for the next one.
        again = await push_and_drop(adm, 1, trainer_version=2)
        await adm.pull_stale_drops()
        assert (await call("stats"))["pending_reissue"] == 1 and not adm.ledger.reissue
        await asyncio.sleep(STALE_POLL_S)
        await adm.pull_stale_drops()
        assert (await call("stats"))["pending_reissue"] == 0 and list(adm.ledger.reissue) == again
    finally:
        handle.close()


def test_at_a_sync_the_next_batch_is_ready_once_the_groups_past_the_synced_version_fill_a_step():
    # 2 steps of 2 groups per version; the engines serve version 1 and the trainer syncs version 2: it has trained
    # (1 + 1) * 4 = 8 groups and takes 2 more next.
    adm = make(eta=1, per_version=4, per_step=2)
    adm.ledger.on_sync(1)
    prompts = [adm.admit_next() for _ in range(adm.ledger.headroom())]
    adm.pushed(prompts[:9])
    assert not adm.next_batch_ready()
    adm.pushed(prompts[9:10])
    assert adm.next_batch_ready()
