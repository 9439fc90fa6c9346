"""handles.resolve_ahead: a reference resolved in a thread, its result or exception handed to whoever resolves the
future (the trainer's prefetched batch)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from fully_async.handles import resolve, resolve_ahead
from fully_async.message_queue import QueueTimeout


def _later(outcome, after_s: float = 0.2) -> concurrent.futures.Future:
    ref: concurrent.futures.Future = concurrent.futures.Future()

    def fill() -> None:
        time.sleep(after_s)
        if isinstance(outcome, BaseException):
            ref.set_exception(outcome)
        else:
            ref.set_result(outcome)

    threading.Thread(target=fill, daemon=True).start()
    return ref


def test_resolve_ahead_returns_at_once_and_hands_over_the_result():
    start = time.monotonic()
    ahead = resolve_ahead(_later([1, 2, 3]))
    assert time.monotonic() - start < 0.1 and not ahead.done()
    assert resolve(ahead) == [1, 2, 3]


def test_resolve_ahead_hands_over_the_exception_with_its_type():
    ahead = resolve_ahead(_later(QueueTimeout("get(4) waited 5.0s")))
    with pytest.raises(QueueTimeout, match="waited 5.0s"):
        resolve(ahead)
