"""BackgroundSync: runs one sync at a time in a kept thread while the trainer's next step computes
(async_training.sync_mode=background).

A sync is two callables: `reads` (the phases that read the trainer's weights) and `rest` (everything after them).
The trainer may change its weights again only once `weights_read` returned; it collects the whole sync with
`collect`. Invariants (tests/unit/sync/test_background.py):
1. One in flight: `submit` while a sync is in flight and not collected raises RuntimeError (the caller collects
   first), so a version's directory or staging buffer is never rewritten while engines read it.
2. `weights_read` returns only once every reading phase ended (done or failed).
3. A failure is kept: `check`, `weights_read`, `collect` and every later `submit` raise it, naming the version.
The thread's results reach the caller's thread only through the lock below and the sync's Future.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

from fully_async.sync.phases import described
from fully_async.threads import CallThread
from fully_async.weights.base import ParamSyncError

Timed = Callable[[dict[str, float]], None]
"""Runs some phases, adding each one's timing to the dict it is given."""


class BackgroundSync:
    def __init__(self) -> None:
        self._worker = CallThread("param-sync")
        self._lock = threading.Lock()
        self._inflight: concurrent.futures.Future | None = None
        """The sync in flight (or finished and not yet collected)."""
        self._read: threading.Event | None = None
        """Set once the sync in flight has read the weights; None: nothing left for `weights_read` to wait for."""
        self._read_timings: dict[str, float] = {}
        self._done: dict[str, float] = {}
        self._failed: ParamSyncError | None = None
        self.completed = 0
        """Syncs whose every phase finished."""

    @property
    def reading(self) -> bool:
        """Whether the sync in flight has reading phases not collected by `weights_read` yet."""
        with self._lock:
            return self._read is not None

    def submit(self, version: int, reads: Timed | None, rest: Timed) -> dict[str, float]:
        """Start the sync of `version` in the kept thread: `reads`, then `rest`. Returns at once, with no timings
        (its phases' come with `weights_read` and `collect`)."""
        with self._lock:
            if self._inflight is not None:
                raise RuntimeError(f"a background sync is in flight: collect it before starting version {version}")
            self._raise_failed()
            read = threading.Event() if reads is not None else None
            read_timings: dict[str, float] = {}
            done: dict[str, float] = {}
            self._read, self._read_timings, self._done = read, read_timings, done
            self._inflight = self._worker.submit(self._run, version, reads, rest, read, read_timings, done)
        return {}

    def _run(self, version: int, reads: Timed | None, rest: Timed, read: threading.Event | None,
             read_timings: dict[str, float], done: dict[str, float]) -> None:  # fmt: skip
        start = time.monotonic()
        try:
            try:
                if reads is not None:
                    reads(read_timings)
            finally:
                if read is not None:
                    read.set()
            rest(done)
            with self._lock:
                self.completed += 1
        except BaseException as e:  # noqa: BLE001 - any failure is the sync's, kept for the trainer's next call
            with self._lock:
                self._failed = _named(version, e)
        finally:
            done["timing_s/param_sync/background"] = time.monotonic() - start

    def weights_read(self) -> dict[str, float]:
        """Wait until the sync in flight has read the weights; returns its reading phases' timings (reported once)
        and `timing_s/param_sync`, the seconds waited ({} when there was nothing to wait for). Raises the sync's
        failure. Bounded as the phases are (each by the sync timeout)."""
        with self._lock:
            read, timings = self._read, self._read_timings
            self._read = None
        if read is None:
            return {}
        start = time.monotonic()
        read.wait()
        t = {**timings, "timing_s/param_sync": time.monotonic() - start}
        self.check()
        return t

    def collect(self) -> dict[str, float]:
        """Wait for the sync in flight to end; returns its phase timings and `timing_s/param_sync/wait`, the seconds
        waited ({} with none in flight). Raises its failure, or an earlier one."""
        start = time.monotonic()
        read = self.weights_read()
        read.pop("timing_s/param_sync", None)  # the caller times its wait
        with self._lock:
            inflight, self._inflight = self._inflight, None
        if inflight is None:
            self.check()
            return read
        inflight.result()  # _run keeps its failure for check()
        with self._lock:
            done = dict(self._done)
        t = {**read, **done, "timing_s/param_sync/wait": time.monotonic() - start}
        self.check()
        return t

    def check(self) -> None:
        """Raise the failure of a sync, if one failed."""
        with self._lock:
            self._raise_failed()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def close(self, wait_s: float) -> None:
        """Give a sync still in flight up to `wait_s` to end (it may still read files), then stop the thread."""
        with self._lock:
            inflight = self._inflight
        if inflight is not None:
            concurrent.futures.wait([inflight], wait_s)
        self._worker.close()


def _named(version: int, e: BaseException) -> ParamSyncError:
    if isinstance(e, ParamSyncError):
        failed = ParamSyncError(f"background sync of version {version}: {e}")
        failed.__cause__ = e.__cause__
        return failed
    return ParamSyncError(f"background sync of version {version} failed: {described(e)}")
