"""fully_async/aio.py: `bounded` keeps a cancellation that meets a result (asyncio.wait_for on Python < 3.12 returns
the result instead: the two-node sync hang of issue 46), a NamedLock waited for too long names its holder, the await
chains of a loop's tasks reach what they wait on, and the package uses no asyncio.wait_for."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from fully_async.aio import LockWaitTimeout, NamedLock, bounded, task_stacks

PACKAGE = Path(__file__).resolve().parents[2] / "fully_async"


async def test_bounded_returns_the_result_or_cancels_what_it_waited_for_on_time_out():
    assert await bounded(asyncio.sleep(0, "done"), 1.0) == "done"
    inner = asyncio.ensure_future(asyncio.sleep(10))
    with pytest.raises(TimeoutError):
        await bounded(inner, 0.05)
    await asyncio.sleep(0)
    assert inner.cancelled()


async def test_a_cancellation_in_the_turn_the_result_arrived_is_kept_not_swallowed():
    result = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(bounded(result, 5.0))
    await asyncio.sleep(0)  # the waiter is waiting
    result.set_result("late")  # the answer and the cancellation in the same turn
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_probe_loop_cancelled_as_its_probe_answers_ends():
    """The shape that hung: a loop re-awaiting a bounded call, cancelled in the turn a call answered."""
    answers: list[asyncio.Future] = []

    async def probe_forever():
        while True:
            answers.append(asyncio.get_running_loop().create_future())
            await bounded(answers[-1], 5.0)

    loop_task = asyncio.ensure_future(probe_forever())
    await asyncio.sleep(0)
    answers[-1].set_result(None)
    loop_task.cancel()
    done, _ = await asyncio.wait({loop_task}, timeout=1.0)
    assert done and loop_task.cancelled()


async def test_a_named_lock_waited_for_too_long_names_its_holder():
    lock = NamedLock("the test lock", wait_s=0.1)
    held, release = asyncio.Event(), asyncio.Event()

    async def stuck_holder():
        async with lock:
            held.set()
            await release.wait()

    holder = asyncio.create_task(stuck_holder(), name="holder-task")
    await held.wait()
    assert "stuck_holder (task holder-task)" in lock.held_by()
    with pytest.raises(LockWaitTimeout, match=r"the test lock was not free within 0.1 s for .*test_a_named_lock_waited"
                                              r".*: held by .*stuck_holder \(task holder-task\) for"):  # fmt: skip
        async with lock:
            pass
    release.set()
    await holder
    assert lock.held_by() == "free" and not lock.locked()
    async with lock:  # free again: taken at once
        assert lock.locked()


async def test_task_stacks_follow_each_await_chain_down_to_what_it_waits_on():
    lock = NamedLock("a lock", wait_s=None)
    await lock.acquire()

    async def inner_wait():
        async with lock:
            pass

    async def outer_wait():
        await inner_wait()

    task = asyncio.create_task(outer_wait(), name="the-waiter")
    await asyncio.sleep(0.01)
    text = task_stacks()
    chain = text[text.index("task the-waiter") :]
    assert re.search(r"in .*outer_wait\n.*in .*inner_wait\n.*in NamedLock.__aenter__", chain), text
    lock.release()
    await task


def test_the_package_uses_no_asyncio_wait_for():
    """asyncio.wait_for can swallow a cancellation (the module docstring of fully_async/aio.py); use `bounded`."""
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py") if p.name != "aio.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if "asyncio.wait_for(" in line]  # fmt: skip
    assert found == []
