"""MessageQueue logic on a plain event loop (the Ray actor wraps this same class: tests/integration)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_async.message_queue import MessageQueue, QueueClosed, QueueTimeout
from fully_async.protocol import PromptRef
from tests.helpers import make_group


async def test_fifo_and_batched_put_get():
    q = MessageQueue(capacity=10, max_staleness=1)
    assert await q.put([make_group(i) for i in range(5)]) == 5
    got = await q.get(3, trainer_version=0)
    assert [g.prompt.index for g in got] == [0, 1, 2]
    assert q.stats()["size"] == 2 and q.stats()["got"] == 3


async def test_full_queue_blocks_the_producer_until_a_get():
    q = MessageQueue(capacity=2, max_staleness=0)
    await q.put([make_group(0), make_group(1)])
    producer = asyncio.create_task(q.put([make_group(2)]))
    await asyncio.sleep(0.05)
    assert not producer.done() and q.size() == 2
    await q.get(1, trainer_version=0)
    assert await asyncio.wait_for(producer, 1) == 2
    assert q.stats()["put_waits"] == 1 and q.stats()["put_wait_s"] > 0.04


async def test_put_timeout_when_full_says_the_state():
    q = MessageQueue(capacity=1, max_staleness=0)
    await q.put([make_group(0)])
    with pytest.raises(QueueTimeout, match="'size': 1"):
        await q.put([make_group(1)], timeout=0.05)
    assert q.size() == 1  # nothing half-put


async def test_oversized_batch_goes_in_when_empty():
    q = MessageQueue(capacity=2, max_staleness=0)
    assert await asyncio.wait_for(q.put([make_group(i) for i in range(5)]), 1) == 5


async def test_stale_groups_are_dropped_and_handed_back_for_reissue():
    q = MessageQueue(capacity=10, max_staleness=1)
    await q.put(
        [make_group(0, version=0), make_group(1, version=2), make_group(2, version=1), make_group(3, version=3)]
    )
    got = await q.get(2, trainer_version=2)  # version 0 is 2 behind: dropped
    assert [g.prompt.index for g in got] == [1, 2]
    assert q.take_reissue() == [PromptRef(0, 0)]
    assert q.take_reissue() == []
    assert q.stats()["dropped_stale"] == 1


async def test_getter_waits_for_enough_fresh_groups():
    q = MessageQueue(capacity=10, max_staleness=0)
    getter = asyncio.create_task(q.get(2, trainer_version=1))
    await q.put([make_group(0, version=0), make_group(1, version=1)])
    await asyncio.sleep(0.05)
    assert not getter.done()  # one stale, one fresh: not enough
    await q.put([make_group(2, version=1)])
    got = await asyncio.wait_for(getter, 1)
    assert [g.prompt.index for g in got] == [1, 2]
    assert q.take_reissue() == [PromptRef(0, 0)]


async def test_close_wakes_blocked_callers_with_the_reason():
    full, short = MessageQueue(capacity=1, max_staleness=0), MessageQueue(capacity=2, max_staleness=0)
    await full.put([make_group(0)])
    putter = asyncio.create_task(full.put([make_group(1)]))  # full, and no get waits
    getter = asyncio.create_task(short.get(2, trainer_version=0))  # empty
    await asyncio.sleep(0.02)
    await full.close("trainer failed")
    await short.close("trainer failed")
    for task in (getter, putter):
        with pytest.raises(QueueClosed, match="trainer failed"):
            await asyncio.wait_for(task, 1)


async def test_a_batch_without_room_goes_in_when_a_get_waits_for_more_than_the_queue_holds():
    # 3 of 4 held, a get of 4 waiting and a batch of 2 waiting for room would each wait for the other for ever.
    q = MessageQueue(capacity=4, max_staleness=0)
    await q.put([make_group(i) for i in range(3)])
    getter = asyncio.create_task(q.get(4, trainer_version=0))
    await asyncio.sleep(0.02)
    assert await asyncio.wait_for(q.put([make_group(3), make_group(4)]), 1) == 5
    assert [g.prompt.index for g in await asyncio.wait_for(getter, 1)] == [0, 1, 2, 3]
    assert q.size() == 1


async def test_snapshot_restore_round_trip():
    q = MessageQueue(capacity=10, max_staleness=0)
    groups = [make_group(i, version=i % 2) for i in range(4)]
    await q.put(groups)
    await q.get(1, trainer_version=1)  # drops groups 0 and 2 (version 0), returns group 1
    snap = q.snapshot()
    fresh = MessageQueue(capacity=10, max_staleness=0)
    assert await fresh.restore(snap) == 1
    assert fresh.take_reissue() == [PromptRef(0, 0), PromptRef(0, 2)]
    got = await fresh.get(1, trainer_version=1)
    assert got[0].same_as(groups[3])
    assert fresh.stats()["dropped_stale"] == 2


@pytest.mark.parametrize("tune_gc", [False, True])
def test_gc_tuning_only_where_asked(tune_gc):
    # A fresh interpreter: the setting is process-wide. The actor asks for it (create_message_queue); a queue built in
    # any other process must leave that process's collector as it was.
    code = (
        "import gc\n"
        "from fully_async.gc_tuning import YOUNG_THRESHOLD\n"
        "from fully_async.message_queue import MessageQueue\n"
        "default = gc.get_threshold()\n"
        f"MessageQueue(4, 1, tune_gc={tune_gc})\n"
        "print(default[0], gc.get_threshold()[0], YOUNG_THRESHOLD, gc.get_freeze_count() > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    default, now, young, frozen = out.stdout.split()
    assert (now, frozen) == ((young, "True") if tune_gc else (default, "False"))


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 4),
    trainer_version=st.one_of(st.integers(0, 10), st.integers(6, 10**9)),
    lags=st.lists(st.integers(0, 8), min_size=1, max_size=12),
)
def test_get_hands_out_only_groups_within_the_bound_at_any_version(eta, trainer_version, lags):
    """Groups lagging 0..8 versions behind a trainer at version 0..10^9: get returns exactly the fresh ones, oldest
    first; every stale one is dropped and handed back for re-issue, none is lost."""

    async def run():
        q = MessageQueue(capacity=len(lags), max_staleness=eta)
        groups = [make_group(i, version=max(0, trainer_version - lag)) for i, lag in enumerate(lags)]
        await q.put(groups)
        fresh = [g for g in groups if trainer_version - g.min_version <= eta]
        if fresh:
            got = await q.get(len(fresh), trainer_version, timeout=0.01)
        else:  # nothing to hand out: the get times out, having dropped the stale groups on the way
            with pytest.raises(QueueTimeout):
                await q.get(1, trainer_version, timeout=0.001)
            got = []
        return groups, fresh, got, q.take_reissue()

    groups, fresh, got, reissued = asyncio.run(run())
    assert [g.prompt for g in got] == [g.prompt for g in fresh]
    assert sorted(reissued) == sorted(g.prompt for g in groups if trainer_version - g.min_version > eta)
