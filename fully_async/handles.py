"""How the trainer-side roles (Trainer, ParamSync, weight transports) call the actors they drive.

In a run the rollouter and the queue are Ray actors: `actor.method.remote(...)` returns an ObjectRef and `resolve`
waits for it with ray.get. `LocalActor` gives a plain object (the MessageQueue class, a rollouter stand-in) the same
calling convention inside this process, so the roles run and are tested without Ray: its calls return
concurrent.futures.Future, which `resolve` waits for without importing Ray.

A running job's Rollouter is also a named actor (`rollouter_name(run_dir)` in the NAMESPACE namespace): operator
commands (fully_async/ctl.py) find the job through it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from pathlib import Path
from typing import Any

NAMESPACE = "fully_async"
"""Ray namespace of the named Rollouter actors that fully_async.ctl looks up."""
ROLLOUTER_PREFIX = "rollouter:"


def rollouter_name(run_dir: str | Path) -> str:
    """The Rollouter's actor name for a run: unique per run directory on one cluster."""
    return ROLLOUTER_PREFIX + str(Path(run_dir).resolve())


def resolve(ref: Any, timeout: float | None = None) -> Any:
    """The result of an actor call (Ray ObjectRef or LocalActor future); the callee's exception is raised here."""
    if isinstance(ref, concurrent.futures.Future):
        return ref.result(timeout)
    import ray

    return ray.get(ref, timeout=timeout)


def one_line(e: BaseException) -> str:
    """`Type: first line of the message`, for a log line: Ray's errors carry the remote traceback and the actor's
    details on the lines after."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def dead_nodes() -> set[str]:
    """Ids of the Ray nodes Ray reports dead (none outside Ray). Blocking: one question to Ray's node table."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if not n["Alive"]} if ray.is_initialized() else set()


async def resolve_async(ref: Any) -> Any:
    """`resolve` from inside an event loop, without blocking it: a Ray ObjectRef is awaited, a LocalActor future is
    wrapped for this loop."""
    if isinstance(ref, concurrent.futures.Future):
        return await asyncio.wrap_future(ref)
    return await ref


class _Method:
    def __init__(self, actor: LocalActor, name: str) -> None:
        self._actor, self._name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self._actor._submit(self._name, args, kwargs)


class LocalActor:
    """`obj`'s methods callable as `handle.name.remote(*args)`, run one at a time in order of call on a private event
    loop thread, as an async Ray actor runs them (coroutine methods interleave at their awaits; plain methods run on
    the loop). `close()` stops the thread."""

    def __init__(self, obj: Any, name: str = "local-actor") -> None:
        self.obj = obj
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or not callable(getattr(self.obj, name, None)):
            raise AttributeError(name)
        return _Method(self, name)

    def _submit(self, name: str, args: tuple, kwargs: dict) -> concurrent.futures.Future:
        async def call() -> Any:
            out = getattr(self.obj, name)(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out

        return asyncio.run_coroutine_threadsafe(call(), self._loop)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
