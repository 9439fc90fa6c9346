"""fully_async/engines/hung.py: a set-aside server's engine host that does not answer is waited out until it answers
(alive: restart in place), is reported gone or its node dead, or engine.hung_host_s passes (gone: replace). A host
whose questions all time out is scripted; the clock is counted in questions, so nothing here sleeps."""

from __future__ import annotations

import itertools

from fully_async.engines.hung import wait_for_host


class ScriptedHost:
    """A `RemoteServer` whose host answers the questions in `answers` (None: no answer in time), then None."""

    url = "http://127.0.0.1:1"

    def __init__(self, *answers: bool | None) -> None:
        self.answers = list(answers)
        self.asked: list[float] = []

    def host_answers(self, timeout_s: float) -> bool | None:
        self.asked.append(timeout_s)
        return self.answers.pop(0) if self.answers else None


def _wait(proc, node_dead=lambda: False, hung_host_s=100.0, closed=lambda: False):
    clock = itertools.count().__next__  # one second per look at the clock
    return wait_for_host(proc, node_dead, 2.0, hung_host_s, closed=closed, clock=clock, poll_s=0)


def test_a_host_that_answers_is_alive_at_once_and_one_reported_gone_is_gone_at_once():
    alive, gone = ScriptedHost(True), ScriptedHost(False)
    assert _wait(alive) == "alive" and alive.asked == [2.0]  # each question within the deadline
    assert _wait(gone) == "gone" and gone.asked == [2.0]


def test_a_silent_host_that_answers_again_is_alive():
    proc = ScriptedHost(None, None, None, True)
    assert _wait(proc) == "alive" and len(proc.asked) == 4


def test_a_silent_host_is_gone_when_ray_declares_its_node_dead():
    proc = ScriptedHost()
    looks = iter([False, False, True])
    assert _wait(proc, node_dead=lambda: next(looks)) == "gone" and len(proc.asked) == 3


def test_a_silent_host_on_a_node_ray_keeps_alive_is_hung_after_the_bound():
    proc = ScriptedHost()
    assert _wait(proc, hung_host_s=5.0) == "hung" and len(proc.asked) == 6  # silent at t=0..5 on the counted clock


def test_a_pool_that_stops_ends_the_wait():
    proc = ScriptedHost()
    stops = iter([False, True])
    assert _wait(proc, closed=lambda: next(stops)) == "gone" and len(proc.asked) == 2
