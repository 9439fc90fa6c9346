"""threads.CallThread: calls run in one kept thread, in the order given, each result or exception handed to whoever
resolves its future (the trainer's prefetched batch, its step report and writes; ParamSync's syncs and phases)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from fully_async.handles import resolve
from fully_async.message_queue import QueueTimeout
from fully_async.threads import CallThread


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


def test_submit_returns_before_the_call_ends_and_hands_over_the_result():
    calls = CallThread("test")
    ref: concurrent.futures.Future = concurrent.futures.Future()  # filled only by this test, after submit returned
    ahead = calls.submit(resolve, ref)
    assert not ahead.done()  # a submit that waited for its call would never have returned (nobody fills ref)
    ref.set_result([1, 2, 3])
    assert resolve(ahead) == [1, 2, 3]
    calls.close()


def test_submit_hands_over_the_exception_with_its_type():
    calls = CallThread("test")
    ahead = calls.submit(resolve, _later(QueueTimeout("get(4) waited 5.0s")))
    with pytest.raises(QueueTimeout, match="waited 5.0s"):
        resolve(ahead)
    calls.close()


def test_calls_run_in_order_in_one_kept_thread_and_close_ends_it():
    calls = CallThread("test-order")
    seen: list = []

    def note(i: int, pause: float) -> str:
        time.sleep(pause)
        seen.append(i)
        return threading.current_thread().name

    futures = [calls.submit(note, i, 0.05 if i == 0 else 0.0) for i in range(5)]
    names = {f.result(5) for f in futures}
    assert seen == [0, 1, 2, 3, 4] and names == {"test-order"}
    thread = calls._thread
    calls.close()
    thread.join(5)
    assert not thread.is_alive()
