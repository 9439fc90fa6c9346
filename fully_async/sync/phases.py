"""PhaseRunner: runs one phase of a sync, timed (`timing_s/param_sync/<name>`), traced on the `sync` lane and bounded
by advanced.sync_timeout_s; a phase that fails or passes the bound raises ParamSyncError naming it."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from fully_async.threads import CallThread
from fully_async.trace import Tracer
from fully_async.weights.base import ParamSyncError


class PhaseRunner:
    def __init__(
        self,
        timeout_s: float,
        tracer: Tracer | None = None,
        pending: Callable[[], str] | None = None,
        diagnose: Callable[[], str] | None = None,
    ) -> None:
        """`pending`: who a phase that hangs still waits for (the transport's `pending`), for the timeout's first line;
        `diagnose`: where the other side is stuck (the Rollouter's tasks and control calls), on the lines after it."""
        self.timeout_s, self.tracer = timeout_s, tracer
        self.pending = pending or (lambda: "")
        self.diagnose = diagnose or (lambda: "")
        self._thread = CallThread("param-sync-phase")

    def run(self, name: str, timings: dict[str, float], fn: Callable[[], Any]) -> Any:
        """Run `fn` in the runner's kept thread (named after the phase while it runs) and wait at most timeout_s for
        it. A phase that hangs (a peer that never answers) is left behind in that thread, and later phases get a new
        one: daemon threads, so one can never hold the interpreter's exit (a pool thread would: Python joins those
        at exit, and a CI run once waited out its time limit on one)."""
        start, wall = time.monotonic(), time.time()
        future = self._thread.submit(_named, f"param-sync-{name}", fn)
        try:
            done, _ = concurrent.futures.wait([future], self.timeout_s)
            if not done:
                self._thread = CallThread("param-sync-phase")
                waiting, where = self.pending(), self.diagnose()
                raise ParamSyncError(
                    f"weight sync phase '{name}' did not finish within advanced.sync_timeout_s="
                    f"{self.timeout_s:g}s" + (f" ({waiting})" if waiting else "") + (f"\n{where}" if where else "")
                )
            e = future.exception()
            if e is not None:
                raise ParamSyncError(f"weight sync phase '{name}' failed: {described(e)}") from e
            return future.result()
        finally:
            self._timed(name, timings, start, wall)

    def inline(self, name: str, timings: dict[str, float], fn: Callable[[], Any]) -> Any:
        """Run a phase that only hands work over (it cannot block: a plan's `queue`) in the
        caller's thread, timed and named on failure like the others."""
        start, wall = time.monotonic(), time.time()
        try:
            return fn()
        except Exception as e:
            raise ParamSyncError(f"weight sync phase '{name}' failed: {described(e)}") from e
        finally:
            self._timed(name, timings, start, wall)

    def _timed(self, name: str, timings: dict[str, float], start: float, wall: float) -> None:
        timings[f"timing_s/param_sync/{name}"] = time.monotonic() - start
        if self.tracer is not None:
            self.tracer.record("sync", name, wall, time.time())

    def close(self) -> None:
        self._thread.close()


def _named(name: str, fn: Callable[[], Any]) -> Any:
    """Run `fn` in the current thread renamed `name` (the phase's: a stack dump of a hung sync names its phase)."""
    threading.current_thread().name = name
    return fn()


def described(e: BaseException) -> str:
    """`Type: message` of a phase's failure; for an error raised in a Ray task, the remote exception's own (the
    RayTaskError's first line only says `ray::task() (pid=...)`; its remote traceback goes to the run's
    logs/error.log), so the console's one line names what failed."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause} (in a Ray task)"
    return f"{type(e).__name__}: {e}"


def add_timings(m: dict[str, Any], timings: dict[str, float]) -> None:
    """Add a sync's timings into `m`, summing a key met twice (the seconds held, a phase of two syncs)."""
    for key, value in timings.items():
        m[key] = m.get(key, 0.0) + value
