"""Bounded awaits that never lose a cancellation, a lock that names its holder, and the stacks of an event loop's tasks.

Why not `asyncio.wait_for`: on Python < 3.12 it returns the inner result when the task awaiting it is cancelled in
the turn that result arrived, swallowing the cancellation. A loop that re-awaits (a liveness probe every second) then
never ends, and whoever cancelled it and waits for it waits forever: the two-node hang of issue 46, a weight sync
stuck in 'reload' after every server had reloaded. `bounded` bounds the await in the caller's own task with
`asyncio.timeout` (Python 3.11+), which passes a cancellation on as it comes; the package uses it everywhere
(tests/unit/test_aio.py keeps `asyncio.wait_for` out of fully_async/ but here).
"""

from __future__ import annotations

import asyncio
import inspect
import io
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

_timeout = getattr(asyncio, "timeout", None)


async def bounded(aw: Awaitable[T], seconds: float | None) -> T:
    """`await aw` within `seconds` (None: unbounded): TimeoutError (the builtin, as asyncio's) when it does not finish
    in time, after cancelling it. `aw` runs in the caller's own task (asyncio.timeout), so a cancellation reaches it
    and goes on up as it came, and what `aw` does on its cancellation (a condition re-taking its lock) is done before
    this returns."""
    if seconds is None:
        return await aw
    if _timeout is None:  # Python 3.10: no asyncio.timeout; wait_for's flaw above stays there
        return await asyncio.wait_for(aw, seconds)
    async with _timeout(max(0.0, seconds)):
        return await aw


class LockWaitTimeout(TimeoutError):
    """A `NamedLock` was not free within its bound; the message names the lock and who held it since when."""


class NamedLock:
    """An asyncio.Lock that knows who holds it (the acquiring function and task) and is waited for at most `wait_s`:
    `async with lock:` raises LockWaitTimeout naming the holder instead of waiting forever behind a holder that hangs.
    Bound to the event loop that first waits on it, as asyncio.Lock."""

    def __init__(self, name: str, wait_s: float | None) -> None:
        self.name, self.wait_s = name, wait_s
        self._lock = asyncio.Lock()
        self.holder: str | None = None
        self._since = 0.0

    def locked(self) -> bool:
        return self._lock.locked()

    def held_by(self) -> str:
        """Who holds the lock and for how long ("free" when nobody does)."""
        if self.holder is None:
            return "free"
        return f"held by {self.holder} for {time.monotonic() - self._since:.1f} s"

    async def acquire(self, who: str | None = None) -> None:
        who = who or _caller(2)
        try:
            await bounded(self._lock.acquire(), self.wait_s)
        except TimeoutError as e:
            raise LockWaitTimeout(
                f"{self.name} was not free within {self.wait_s:g} s for {who}: {self.held_by()}"
            ) from e
        self.holder, self._since = who, time.monotonic()

    def release(self) -> None:
        self.holder = None
        self._lock.release()

    async def __aenter__(self) -> NamedLock:
        await self.acquire(_caller(2))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


def _caller(depth: int) -> str:
    """`function (task name)` of the frame `depth` levels above this one's caller."""
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
    where = getattr(frame.f_code, "co_qualname", frame.f_code.co_name) if frame is not None else "?"
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    return f"{where} (task {task.get_name()})" if task is not None else where


def task_stacks(limit: int = 16, skip_current: bool = True) -> str:
    """The pending tasks of the running event loop, each with its await chain (outermost first, down to what it waits
    on), as text: what a stuck actor is waiting for, without a debugger. `limit`: frames per task."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if not (skip_current and t is current)]
    out = io.StringIO()
    out.write(f"{len(tasks)} pending asyncio tasks of the event loop\n")
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"- task {task.get_name()}:\n")
        for line in await_chain(task.get_coro(), limit):
            out.write(f"    {line}\n")
    return out.getvalue()


def await_chain(coro: Any, limit: int = 16) -> list[str]:
    """`file:line in function` for each coroutine in the chain `coro` awaits, outermost first, then what the innermost
    one waits on (a future, a lock's waiter, ...). Task.get_stack shows only the outermost frame of a suspended
    coroutine."""
    lines: list[str] = []
    while coro is not None and len(lines) < limit:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            lines.append(f"waits on {type(coro).__name__}: {coro!r}"[:300])
            break
        code = frame.f_code
        lines.append(f"{code.co_filename}:{frame.f_lineno} in {getattr(code, 'co_qualname', code.co_name)}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines
