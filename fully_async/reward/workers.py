"""Worker processes for synchronous reward functions, with a hard per-call timeout.

A call that passes its timeout gets its worker process SIGKILLed and replaced: no thread keeps running a hung
verifier, and CPU-heavy scoring never blocks the caller's event loop (results are awaited through the pipe's file
descriptor). Functions are named by dotted path and resolved inside the worker; arguments and results travel
between our own processes only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from typing import Any

from fully_async.aio import bounded
from fully_async.plugins import load

log = logging.getLogger(__name__)


class RewardTimeout(TimeoutError):
    """A reward call ran past its timeout; its worker was killed."""


class RewardCallError(RuntimeError):
    """A reward function raised, or its worker died; the message carries the function's traceback."""


def _worker_main(conn: Connection) -> None:
    cache: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        path, kwargs = msg
        try:
            fn = cache.get(path) or cache.setdefault(path, load(path, "reward function"))
            conn.send(("started", None))  # the import is done: the parent's timeout clock starts now
            conn.send(("ok", fn(**kwargs)))
        except BaseException:  # report every failure to the parent; the worker stays usable
            conn.send(("error", traceback.format_exc(limit=8)))


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="fully_async-reward")
        self.proc.start()
        child.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class ScoringPool:
    """`num_workers` processes; `await call(path, kwargs, timeout)` runs path(**kwargs) in one of them."""

    def __init__(self, num_workers: int, start_method: str = "spawn") -> None:
        self._ctx = mp.get_context(start_method)
        self._workers = [_Worker(self._ctx) for _ in range(num_workers)]
        self._idle: asyncio.Queue[_Worker] | None = None
        self.killed = 0

    def _idle_queue(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:  # created on first use, inside the caller's event loop
            self._idle = asyncio.Queue()
            for w in self._workers:
                self._idle.put_nowait(w)
        return self._idle

    async def call(self, path: str, kwargs: dict[str, Any], timeout: float, import_timeout: float = 300.0) -> Any:
        """path(**kwargs) in a worker. `timeout` bounds the call itself; importing the function's module the first
        time in a worker (verl's scorers take seconds) has its own, generous bound."""
        idle = self._idle_queue()
        worker = await idle.get()
        try:
            worker.conn.send((path, kwargs))
            phase, limit = "import", import_timeout
            status, payload = await bounded(self._recv(worker.conn), limit)
            if status == "started":
                phase, limit = "call", timeout
                status, payload = await bounded(self._recv(worker.conn), limit)
        except asyncio.TimeoutError:
            worker = self._replace(worker, f"{path} passed its {limit:g}s {phase} timeout")
            raise RewardTimeout(f"{path} did not return within {limit:g}s; its worker process was killed") from None
        except (EOFError, OSError) as e:
            worker = self._replace(worker, f"worker died running {path}: {e!r}")
            raise RewardCallError(f"the reward worker died while running {path}") from e
        finally:
            idle.put_nowait(worker)
        if status == "error":
            raise RewardCallError(f"{path} raised:\n{payload}")
        return payload

    @staticmethod
    async def _recv(conn: Connection) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(conn.fileno())
        return conn.recv()

    def _replace(self, worker: _Worker, why: str) -> _Worker:
        log.warning("reward worker pid %s killed and replaced: %s", worker.proc.pid, why)
        worker.kill()
        self.killed += 1
        fresh = _Worker(self._ctx)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        for w in self._workers:
            with contextlib.suppress(OSError):  # already dead: kill() below reaps it
                w.conn.send(None)
            w.kill()
