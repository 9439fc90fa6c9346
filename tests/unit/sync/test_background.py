"""BackgroundSync's invariants (fully_async/sync/background.py), each proven with events, not wall-clock bounds:
one sync in flight, `weights_read` returns only after the reading phases, a failure is kept for every later call."""

from __future__ import annotations

import threading

import pytest

from fully_async.sync import BackgroundSync
from fully_async.weights.base import ParamSyncError


def _gate() -> tuple[threading.Event, threading.Event, object]:
    """A phase that says it started, then waits for its release."""
    started, release = threading.Event(), threading.Event()

    def phase(timings: dict) -> None:
        started.set()
        assert release.wait(10)
        timings["timing_s/param_sync/gated"] = 0.0

    return started, release, phase


def test_a_second_submit_while_one_is_in_flight_is_refused_until_it_is_collected():
    bg = BackgroundSync()
    started, release, rest = _gate()
    try:
        bg.submit(1, None, rest)
        assert started.wait(10)
        with pytest.raises(RuntimeError, match="in flight: collect it before starting version 2"):
            bg.submit(2, None, lambda t: None)
        release.set()
        done = bg.collect()
        assert "timing_s/param_sync/gated" in done and "timing_s/param_sync/wait" in done
        ran = threading.Event()
        bg.submit(2, None, lambda t: ran.set())  # collected: the next one may start
        bg.collect()
        assert ran.is_set() and bg.completed == 2
    finally:
        release.set()
        bg.close(10)


def test_weights_read_returns_only_after_the_reading_phases_and_reports_them_once():
    bg = BackgroundSync()
    started, release, reads = _gate()
    rest_ran = threading.Event()
    returned = threading.Event()
    try:
        bg.submit(1, reads, lambda t: rest_ran.set())
        assert started.wait(10) and bg.reading
        waiter = threading.Thread(target=lambda: (bg.weights_read(), returned.set()), daemon=True)
        waiter.start()
        assert not returned.wait(0.2)  # the reading phase is held: weights_read must still be waiting
        assert not rest_ran.is_set()  # and nothing after the reads ran before them
        release.set()
        assert returned.wait(10)
        assert not bg.reading and bg.weights_read() == {}  # reported once
        bg.collect()
        assert rest_ran.is_set()
    finally:
        release.set()
        bg.close(10)


def test_a_failure_is_kept_and_raised_by_every_later_call_naming_the_version():
    bg = BackgroundSync()

    def reads(timings: dict) -> None:
        raise ParamSyncError("weight sync phase 'export' failed: disk full")

    rest_ran = threading.Event()
    try:
        bg.submit(7, reads, lambda t: rest_ran.set())
        for call in (bg.weights_read, bg.collect, bg.check, lambda: bg.submit(8, None, lambda t: None)):
            with pytest.raises(ParamSyncError, match="background sync of version 7: weight sync phase 'export'"):
                call()
        assert not rest_ran.is_set()  # a failed read runs nothing on the engines
        assert bg.completed == 0
    finally:
        bg.close(10)


def test_an_unexpected_exception_becomes_a_param_sync_error_with_its_type():
    bg = BackgroundSync()

    def rest(timings: dict) -> None:
        raise KeyError("server-3")

    try:
        bg.submit(2, None, rest)
        with pytest.raises(ParamSyncError, match="background sync of version 2 failed: KeyError"):
            bg.collect()
    finally:
        bg.close(10)
