"""Kept threads for the trainer-side roles: `CallThread` runs the calls handed to it in one daemon thread, in order,
and `settle` hands a call's result or exception to a future. The Trainer's helpers and ParamSync's background sync run
their calls here (calling Ray actors themselves is fully_async/handles.py's)."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any


def settle(future: concurrent.futures.Future, fn: Callable[..., Any], *args: Any) -> None:
    """Give `future` the result of `fn(*args)`, or its exception."""
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to whoever resolves the future
        future.set_exception(e)


class CallThread:
    """One daemon thread that runs the calls handed to it, one after the other in the order given; `submit` returns a
    Future at once. Kept for the life of its owner: starting a thread per call costs the caller a hand-over of the
    interpreter lock each time (about 1 ms of the trainer's step on two cores, measured), and a daemon thread, so
    that a call that never returns cannot hold the interpreter's exit (a pool thread would: Python joins those)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run `fn(*args)` after the calls submitted before; the future gives its result or raises its exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._calls.put((future, fn, args))
        return future

    def _loop(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if future is None:
                return
            if future.set_running_or_notify_cancel():
                settle(future, fn, *args)

    def close(self) -> None:
        """End the thread once the calls already submitted ran (a call submitted after this is never run)."""
        with self._lock:
            if self._thread is not None:
                self._calls.put((None, None, None))
